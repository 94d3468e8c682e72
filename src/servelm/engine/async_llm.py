"""AsyncLLM: the API process's engine front. It owns everything between a validated request and
the engine core: input processing, the n fan-out, detokenization, stop strings and abort.

    server ──prompts / chat messages──▶ AsyncLLM.encode_prompts / render_chat   (thread pool)
           ──token ids + params──────▶ AsyncLLM.check_prompts                  (PromptError → 400)
           ──GenerationRequest───────▶ AsyncLLM.generate() → GenerationStream
                                          start():  FanOut.first_requests() ──▶ AsyncEngineClient ──▶ core
                                          deltas(): core outputs ──▶ FanOut.process() ──▶ ChoiceDelta batches
                                                    (and releases siblings, aborts stop-string finishes)
                                          close():  abort whatever is unfinished

The server only validates HTTP bodies and renders deltas as JSON or SSE. The offline `LLM`
runs the same FanOut over an in-process core.

Contract: everything is called from the API process's event loop. `GenerationStream.close()`
is the one exit path and is synchronous, so it is safe inside a cancelled task (a client that
disconnected mid-stream) where a further await could be cancelled again; calling it twice is safe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from servelm.config import EngineConfig
from servelm.datatypes import DEFAULT_SLO, EngineOutput, EngineRequest, KVTransferParams, RequestSlo
from servelm.delivery.sources import is_remote
from servelm.engine.async_client import AsyncEngineClient, EngineDeadError
from servelm.engine.fan_out import Choice, ChoiceDelta, FanOut
from servelm.obs.metrics import FinishedRequest
from servelm.obs.timeline import ApiStamp, RequestTimeline
from servelm.sampling_params import SamplingParams
from servelm.tokenization.loading import load_tokenizer
from servelm.tokenization.prompt_tokenizer import PromptTokenizer


class PromptError(ValueError):
    """A prompt the engine cannot run (empty, too long, unknown token ids): the client's error."""

    def __init__(self, message: str, code: str | None = None, by_completion: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.by_completion = by_completion  # the prompt fits; the completion asked for does not


class GenerationObserver(Protocol):
    """Receives per-choice measurements as a stream runs (the server's metrics)."""

    def observe_token_gap(self, slo: RequestSlo, gap_s: float) -> None: ...

    def observe_output_backlog(self, slo: RequestSlo, num_outputs: int) -> None: ...

    def observe_finished(self, request: FinishedRequest) -> None: ...


@dataclass
class GenerationRequest:
    """One caller request, tokenized and validated: prompts × params.n choices."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    timeline: RequestTimeline  # stamped as the request moves; RECEIVED must be stamped already
    priority: int = 0
    cache_salt: str | None = None  # the prefix-cache namespace of every engine request here
    slo: RequestSlo = DEFAULT_SLO  # the caller's tenant and SLO class (servelm.tenancy)
    kv_transfer: KVTransferParams | None = None  # disaggregation: its side of a hand-off (n = 1 only)
    lora_name: str | None = None  # the LoRA adapter the request's `model` named (None: the base model)


class AsyncLLM:
    def __init__(self, client: AsyncEngineClient, tokenizer: PromptTokenizer) -> None:
        """Use `AsyncLLM.start()`; this wraps an already started client."""
        assert client.ready is not None, "the engine client must be started"
        self.client = client
        self.tokenizer = tokenizer
        self.max_model_len = client.ready.max_model_len
        self.vocab_size = client.ready.vocab_size
        self.block_size = client.ready.block_size
        # Fire-and-forget aborts from close(), referenced until done so they are not GC'd.
        self._background: set[asyncio.Task[Any]] = set()
        self._live_streams: dict[str, GenerationStream] = {}  # started and not closed, by request id

    @classmethod
    async def start(
        cls, config: EngineConfig, tokenizer_threads: int = 2, on_phase: Callable[[str], None] | None = None
    ) -> AsyncLLM:
        """Spawn the engine core; the core loads the model in its own process while this one loads the
        tokenizer (a remote model's once the core has pulled it: from the directory it reports).
        `on_phase` hears each start-up phase the core enters (servelm.obs.startup)."""
        client = AsyncEngineClient(config)
        client.on_phase = on_phase
        remote = is_remote(config.model.model)
        tokenizer_load = None if remote else asyncio.create_task(asyncio.to_thread(load_tokenizer, config.model.model))
        try:
            await client.start()
            assert client.ready is not None
            if tokenizer_load is None:
                tokenizer_load = asyncio.create_task(asyncio.to_thread(load_tokenizer, client.ready.source))
            tokenizer = await tokenizer_load
        except BaseException:  # the core's failure, the tokenizer's, or a shutdown cancelling the start
            if tokenizer_load is not None:
                tokenizer_load.cancel()
            await client.shutdown()
            raise
        return cls(client, PromptTokenizer(tokenizer, max_workers=tokenizer_threads))

    @property
    def num_outputs_queued(self) -> int:
        """Engine outputs received here that their streams have not taken yet (the output backlog, now)."""
        return sum(stream.num_outputs_queued for stream in self._live_streams.values())

    async def shutdown(self) -> None:
        await self.client.shutdown()
        self.tokenizer.shutdown()

    # -- input processing ------------------------------------------------------------

    async def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt: text is tokenized (off the event loop when long), ids pass through."""
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self.tokenizer.encode_many(texts)) if texts else iter(())
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:  # fmt: skip
        """Token ids of a conversation (with function `tools`, if any) through the model's chat
        template; PromptError when it refuses."""
        try:
            return await self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools)
        except Exception as exc:
            raise PromptError(f"The chat template could not render these messages: {exc}") from exc

    def check_prompts(self, prompts: list[list[int]], params: SamplingParams, check_ids: bool = False) -> None:
        """PromptError for an empty or too-long prompt, or (check_ids: ids the caller sent) an id
        outside the vocabulary."""
        for prompt in prompts:
            if not prompt:
                raise PromptError("The prompt is empty: at least one token is needed.")
            wanted = len(prompt) + (params.max_tokens or 1)
            if len(prompt) >= self.max_model_len or wanted > self.max_model_len:
                raise PromptError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{wanted} tokens ({len(prompt)} in the prompt, {params.max_tokens or 1} for the completion). "
                    "Please reduce the length of the prompt or of the completion.",
                    code="context_length_exceeded",
                    by_completion=len(prompt) < self.max_model_len,
                )
            if params.structured_resume_tokens >= len(prompt):
                raise PromptError(
                    f"structured_resume_tokens ({params.structured_resume_tokens}) must be fewer than the prompt's "
                    f"{len(prompt)} tokens"
                )
            # After the length check, so a huge prompt is rejected without a scan on the event loop.
            if check_ids:
                self.check_token_ids(prompt)

    def check_token_ids(self, token_ids: list[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"Token id {bad} is out of range: the vocabulary has {self.vocab_size} tokens.")

    # -- generation ------------------------------------------------------------------

    def generate(self, request: GenerationRequest, observer: GenerationObserver | None = None) -> GenerationStream:
        """A stream for `request`; nothing reaches the core before its `start()`."""
        fan_out = FanOut(
            request_id=request.request_id,
            prompts=request.prompts,
            params=request.params,
            decoder=self.tokenizer.decoder,
            block_size=self.block_size,
            priority=request.priority,
            arrival_time=request.timeline.wall[ApiStamp.RECEIVED],
            cache_salt=request.cache_salt,
            slo=request.slo,
            kv_transfer=request.kv_transfer,
            lora_name=request.lora_name,
        )
        return GenerationStream(self, fan_out, request.timeline, observer)

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


@dataclass
class GenerationStream:
    """One request's choices running in the core, as batches of deltas (see the module docstring)."""

    engine: AsyncLLM
    fan_out: FanOut
    timeline: RequestTimeline
    observer: GenerationObserver | None = None
    # Every choice's outputs, in arrival order (with one choice: that engine request's own queue).
    _queue: asyncio.Queue[EngineOutput] = field(default_factory=asyncio.Queue)
    _forwarders: list[asyncio.Task[None]] = field(default_factory=list)
    _last_output_mono: dict[int, float] = field(default_factory=dict)  # choice index → its last token's arrival
    _first_output_mono: dict[int, float] = field(default_factory=dict)  # choice index → its first token's arrival
    _max_gap_s: dict[int, float] = field(default_factory=dict)  # choice index → its longest gap between tokens
    _closed: bool = False

    @property
    def request_id(self) -> str:
        return self.fan_out.request_id

    @property
    def prompts(self) -> list[list[int]]:
        return self.fan_out.prompts

    @property
    def choices(self) -> list[Choice]:
        return self.fan_out.choices

    @property
    def priority(self) -> int:
        return self.fan_out.priority

    @property
    def slo(self) -> RequestSlo:
        return self.fan_out.slo

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated so far, over every choice."""
        return sum(len(c.state.output_token_ids) for c in self.fan_out.choices if c.state is not None)

    @property
    def num_cached_prompt_tokens(self) -> int:
        return self.fan_out.num_cached_prompt_tokens

    @property
    def error(self) -> str | None:
        return self.fan_out.error

    @property
    def num_outputs_queued(self) -> int:
        return self._queue.qsize()

    async def start(self) -> None:
        """Send the first engine requests; on any failure close() so nothing half-sent stays in the core.
        EngineDeadError when the core is not running."""
        self.engine._live_streams[self.request_id] = self
        try:
            await self._submit_all(self.fan_out.first_requests())
        except BaseException:
            self.close()
            raise

    async def _submit_all(self, requests: list[EngineRequest]) -> None:
        for request in requests:
            choice = self.fan_out.choice_for(request.request_id)
            assert choice.state is not None
            self.timeline.choice_events[choice.index] = choice.state.events
            # Stamped at the hand-off itself: the core may schedule it before this coroutine resumes.
            self.timeline.stamp(ApiStamp.SENT_TO_CORE)
            queue = await self.engine.client.add_request(request)
            if len(self.fan_out.choices) == 1:
                self._queue = queue  # one choice: read its queue directly, no forwarding task per token
            else:
                self._forwarders.append(asyncio.get_running_loop().create_task(_forward(queue, self._queue)))

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Batches of deltas in arrival order until every choice finished (then close() is done)."""
        try:
            while self.fan_out.num_unfinished:
                step = self.fan_out.process(await self._next_outputs())
                if step.to_abort:
                    self.engine._spawn(self.engine.client.abort(step.to_abort))
                self._observe(step.deltas)
                if step.to_submit:
                    await self._submit_released(step.to_submit)
                if step.deltas:
                    yield step.deltas
        finally:
            self.close()

    async def _submit_released(self, requests: list[EngineRequest]) -> None:
        try:
            await self._submit_all(requests)
        except EngineDeadError as exc:  # the core died between the first choice and its siblings
            for request in requests:
                choice = self.fan_out.choice_for(request.request_id)
                assert choice.state is not None
                choice.state.finish_reason, choice.state.error, choice.finished = "error", str(exc), True

    async def _next_outputs(self) -> list[EngineOutput]:
        outputs = [await self._queue.get()]
        while not self._queue.empty():  # coalesce whatever else is already here: one chunk, not several
            outputs.append(self._queue.get_nowait())
        if self.observer is not None:
            self.observer.observe_output_backlog(self.slo, _num_behind(outputs))
        wall, mono = time.time(), time.perf_counter()
        if any(o.new_token_ids for o in outputs):
            self.timeline.stamp(ApiStamp.FIRST_OUTPUT_RECEIVED, wall, mono)
        return outputs

    def _observe(self, deltas: list[ChoiceDelta]) -> None:
        mono = time.perf_counter()
        if any(d.token_ids for d in deltas):
            self.timeline.stamp(ApiStamp.FIRST_TOKEN_DETOKENIZED)
        for delta in deltas:
            index = delta.choice.index
            if delta.token_ids:
                last = self._last_output_mono.get(index)
                if last is None:
                    self._first_output_mono[index] = mono
                else:
                    self._max_gap_s[index] = max(self._max_gap_s.get(index, 0.0), mono - last)
                    if self.observer is not None:
                        self.observer.observe_token_gap(self.slo, mono - last)
                self._last_output_mono[index] = mono
            if delta.finish_reason is not None:
                self._finished(delta.choice, delta.finish_reason, mono)
        if not self.fan_out.num_unfinished:
            self.timeline.stamp(ApiStamp.FINISHED)

    def _finished(self, choice: Choice, finish_reason: str, mono: float) -> None:
        state = choice.state
        if self.observer is None or state is None:
            return
        received = self.timeline.mono[ApiStamp.RECEIVED]
        first = self._first_output_mono.get(choice.index)
        self.observer.observe_finished(
            FinishedRequest(
                slo=self.slo,
                finish_reason=finish_reason,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=len(state.output_token_ids),
                events=state.events,
                e2e_s=mono - received,
                ttft_s=first - received if first is not None else None,
                max_token_gap_s=self._max_gap_s.get(choice.index),
            )
        )

    def close(self) -> None:
        """Abort what is unfinished in the core and here; idempotent, never awaits."""
        if self._closed:
            return
        self._closed = True
        self.engine._live_streams.pop(self.request_id, None)
        for task in self._forwarders:
            task.cancel()
        live = self.fan_out.close()
        if live and self.observer is not None:  # ended early (the client left): what it never took
            self.observer.observe_output_backlog(self.slo, self.num_outputs_queued)
        mono = time.perf_counter()
        for choice in live:
            self._finished(choice, "abort", mono)  # its own ABORT output will never reach us: count it here
        if live:
            self.engine._spawn(self.engine.client.abort([c.engine_id for c in live]))


def _num_behind(outputs: list[EngineOutput]) -> int:
    """Outputs taken at once beyond the newest one per choice: how many engine steps' worth
    (times choices) the stream fell behind. One output (the common case) is 0, without a set."""
    return 0 if len(outputs) == 1 else len(outputs) - len({output.request_id for output in outputs})


async def _forward(source: asyncio.Queue[EngineOutput], target: asyncio.Queue[EngineOutput]) -> None:
    while True:
        output = await source.get()
        target.put_nowait(output)
        if output.finish_reason is not None:
            return
