"""One HTTP request's engine requests, run to completion as one stream of deltas.

    prompts × n  ──▶ choices (one engine request each, id "{request_id}-{index}")
                     └─ core outputs ─▶ OutputProcessor (detokenize, stop strings) ─▶ ChoiceDelta batches

n > 1 shares the prompt's KV blocks: a prompt's first choice goes to the core alone and its
siblings follow as soon as it has produced a token. By then the prompt's full blocks are in
the prefix cache, so each sibling computes only the last partial block instead of the whole
prompt (sent together, they would all be scheduled in one step, before any block is cached).

`close()` is the one exit path: whatever is unfinished is aborted in the core (freeing its
blocks) and forgotten here. It is synchronous, so it is safe inside a cancelled task — a
client that disconnected mid-stream — where a further await could be cancelled again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec

from servelm.datatypes import EngineOutput, EngineRequest, PositionLogprobs
from servelm.engine.async_client import EngineDeadError
from servelm.engine.output_processor import RequestState
from servelm.obs.metrics import FinishedRequest
from servelm.obs.timeline import ApiStamp, RequestTimeline
from servelm.sampling_params import SamplingParams
from servelm.server.context import ServerContext
from servelm.server.errors import unavailable


@dataclass
class Choice:
    index: int  # position in the response's `choices`
    prompt_index: int
    engine_id: str
    params: SamplingParams
    state: RequestState | None = None  # set once submitted
    queue: asyncio.Queue[EngineOutput] | None = None
    finished: bool = False
    last_output_mono: float | None = None


@dataclass
class ChoiceDelta:
    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None = None

    def absorb(self, text: str, token_ids: list[int], logprobs: list[PositionLogprobs] | None) -> None:
        self.text += text
        self.token_ids.extend(token_ids)
        if logprobs:
            self.logprobs = (self.logprobs or []) + list(logprobs)


@dataclass
class Generation:
    ctx: ServerContext
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    timeline: RequestTimeline
    cache_salt: str | None = None  # the prefix-cache namespace of every engine request here
    choices: list[Choice] = field(default_factory=list)
    _by_engine_id: dict[str, Choice] = field(default_factory=dict)
    _siblings: dict[int, list[Choice]] = field(default_factory=dict)  # prompt index → choices not yet sent
    _merged: asyncio.Queue[EngineOutput] | None = None
    _forwarders: list[asyncio.Task] = field(default_factory=list)
    _closed: bool = False

    def __post_init__(self) -> None:
        n = self.params.n
        single = len(self.prompts) == 1 and n == 1
        for p in range(len(self.prompts)):
            for i in range(n):
                index = p * n + i
                engine_id = self.request_id if single else f"{self.request_id}-{index}"
                choice = Choice(index, p, engine_id, _child_params(self.params, i))
                self.choices.append(choice)
                self._by_engine_id[engine_id] = choice
        if not single:
            self._merged = asyncio.Queue()

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Prompt tokens the prefix cache served, once per prompt (its first choice's count,
        as usage counts each prompt once however many choices share it)."""
        n = self.params.n
        leaders = (self.choices[p * n].state for p in range(len(self.prompts)))
        return sum(state.num_cached_tokens for state in leaders if state is not None)

    @property
    def unfinished(self) -> int:
        return sum(1 for c in self.choices if not c.finished)

    async def start(self) -> None:
        """Send every prompt's first choice (and the siblings that cannot share blocks) to the core."""
        n = self.params.n
        for p, prompt in enumerate(self.prompts):
            group = self.choices[p * n : (p + 1) * n]
            share = n > 1 and len(prompt) >= self.ctx.block_size
            now = group[:1] if share else group
            if share:
                self._siblings[p] = group[1:]
            for choice in now:
                await self._submit(choice)

    async def _submit(self, choice: Choice) -> None:
        prompt = self.prompts[choice.prompt_index]
        choice.state = self.ctx.processor.add_request(choice.engine_id, prompt, choice.params)
        self.timeline.choice_events[choice.index] = choice.state.events
        request = EngineRequest(
            request_id=choice.engine_id,
            prompt_token_ids=prompt,
            sampling_params=choice.params,
            priority=self.priority,
            arrival_time=self.timeline.wall[ApiStamp.RECEIVED],
            cache_salt=self.cache_salt,
        )
        # Stamped at the hand-off itself: the core may schedule it before this coroutine resumes.
        self.timeline.stamp(ApiStamp.SENT_TO_CORE)
        try:
            choice.queue = await self.ctx.client.add_request(request)
        except EngineDeadError as exc:
            self.ctx.processor.abort(choice.engine_id)
            choice.state = None
            raise unavailable(f"The engine is not running: {exc}", retry_after_s=30) from exc
        if self._merged is not None:
            self._forwarders.append(asyncio.get_running_loop().create_task(_forward(choice.queue, self._merged)))

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Batches of deltas in arrival order until every choice finished (then close() is done)."""
        try:
            while self.unfinished:
                outputs = await self._next_outputs()
                deltas = self._process(outputs)
                if self._siblings:
                    await self._release_siblings()
                if deltas:
                    yield deltas
        finally:
            self.close()

    async def _next_outputs(self) -> list[EngineOutput]:
        queue = self._merged if self._merged is not None else self.choices[0].queue
        assert queue is not None, "deltas() before start()"
        outputs = [await queue.get()]
        while not queue.empty():  # coalesce whatever else is already here: one chunk, not several
            outputs.append(queue.get_nowait())
        return outputs

    def _process(self, outputs: list[EngineOutput]) -> list[ChoiceDelta]:
        wall, mono = time.time(), time.perf_counter()
        if any(o.new_token_ids for o in outputs):
            self.timeline.stamp(ApiStamp.FIRST_OUTPUT_RECEIVED, wall, mono)
        processed, stopped_by_string = self.ctx.processor.process(outputs)
        if stopped_by_string:
            self.ctx.spawn(self.ctx.client.abort(stopped_by_string))
        merged: dict[int, ChoiceDelta] = {}  # one delta per choice: coalesced outputs become one chunk entry
        for delta in processed:
            choice = self._by_engine_id[delta.request_id]
            if delta.new_token_ids:
                if choice.last_output_mono is not None:
                    self.ctx.metrics.observe_token_gap(self.priority, mono - choice.last_output_mono)
                choice.last_output_mono = mono
            if delta.finish_reason is not None:
                self._finish(choice, delta.finish_reason, mono)
            previous = merged.get(choice.index)
            if previous is None:
                merged[choice.index] = ChoiceDelta(
                    choice, delta.new_text, list(delta.new_token_ids), list(delta.new_logprobs or []) or None,
                    delta.finish_reason, delta.stop_reason, delta.error,
                )  # fmt: skip
            else:
                previous.absorb(delta.new_text, delta.new_token_ids, delta.new_logprobs)
                previous.finish_reason, previous.stop_reason = delta.finish_reason, delta.stop_reason
                previous.error = previous.error or delta.error
        deltas = list(merged.values())
        if any(d.token_ids for d in deltas):
            self.timeline.stamp(ApiStamp.FIRST_TOKEN_DETOKENIZED)
        return deltas

    async def _release_siblings(self) -> None:
        """Send a prompt's waiting siblings once its first choice computed the prompt (or ended)."""
        n = self.params.n
        for p in list(self._siblings):
            leader = self.choices[p * n]
            if leader.finished or (leader.state is not None and leader.state.output_token_ids):
                for choice in self._siblings.pop(p):
                    if leader.state is not None and leader.state.error:
                        choice.finished = True  # the engine failed: the leader's error answers for all
                    else:
                        await self._submit(choice)

    def _finish(self, choice: Choice, finish_reason: str, mono: float) -> None:
        choice.finished = True
        state = choice.state
        assert state is not None
        self.ctx.metrics.observe_finished(
            FinishedRequest(
                priority=self.priority,
                finish_reason=finish_reason,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=len(state.output_token_ids),
                events=state.events,
                e2e_s=mono - self.timeline.mono[ApiStamp.RECEIVED],
            )
        )
        if not self.unfinished:
            self.timeline.stamp(ApiStamp.FINISHED)

    def close(self) -> None:
        """Abort what is unfinished in the core and here; idempotent, never awaits."""
        if self._closed:
            return
        self._closed = True
        for task in self._forwarders:
            task.cancel()
        self._siblings.clear()
        live = [c for c in self.choices if not c.finished and c.state is not None]
        mono = time.perf_counter()
        for choice in live:
            self.ctx.processor.abort(choice.engine_id)
            self._finish(choice, "abort", mono)  # its own ABORT output will never reach us: count it here
        for choice in self.choices:
            choice.finished = True
        if live:
            self.ctx.spawn(self.ctx.client.abort([c.engine_id for c in live]))


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n: one engine request each; seeds differ (seed + index) or all n would be equal;
    only the first scores the prompt (prompt logprobs bypass the prefix cache its siblings hit)."""
    changes: dict = {"n": 1}
    if params.seed is not None and index > 0:
        changes["seed"] = params.seed + index
    if index > 0 and params.prompt_logprobs is not None:
        changes["prompt_logprobs"] = None
    return msgspec.structs.replace(params, **changes)


async def _forward(source: asyncio.Queue[EngineOutput], target: asyncio.Queue[EngineOutput]) -> None:
    while True:
        output = await source.get()
        target.put_nowait(output)
        if output.finish_reason is not None:
            return
