"""One caller request → its engine requests: prompts × n choices, and their outputs back as deltas.

    FanOut(prompts × n) ──first_requests()──▶ core        (each prompt's first choice; see below)
    core outputs ──process()──▶ FanOutStep: deltas per choice (detokenized, stop strings applied),
                                            engine ids to abort (stopped by a stop string),
                                            sibling requests now ready to send

Used by both fronts: the offline `LLM` (stepping an in-process core) and `AsyncLLM` (the API
process, over ZMQ). It never touches a core or a socket itself, so the rules below hold for both:

- Choice i of a prompt is one engine request, id "{request_id}-{index}" (just the request id
  when there is one prompt and n == 1); index = prompt_index * n + i.
- Seeds: choice i samples with `seed + i` (wrapped into int64), or all n choices would be the same sample.
- Only a prompt's first choice asks for prompt logprobs (they bypass the prefix cache the
  siblings hit; the prompt's scores are the same for every choice).
- Siblings share the prompt's KV blocks: a prompt's first choice goes to the core alone and its
  siblings follow once it has produced a token. By then the prompt's full blocks are in the
  prefix cache, so each sibling computes only the last partial block. Sent together they would
  be scheduled in the same step, before any block is cached, and compute the prompt n times.
  A prompt shorter than one block has nothing to share: its choices go together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from servelm.datatypes import DEFAULT_SLO, EngineOutput, EngineRequest, KVTransferParams, PositionLogprobs, RequestSlo
from servelm.engine.output_state import RequestState
from servelm.sampling_params import SamplingParams


@dataclass
class Choice:
    index: int  # position among the request's choices (prompt_index * n + i)
    prompt_index: int
    engine_id: str
    params: SamplingParams
    state: RequestState | None = None  # set once its engine request is made
    finished: bool = False


@dataclass
class ChoiceDelta:
    """What one batch of outputs added to one choice (several outputs of a choice coalesce)."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None = None


@dataclass
class FanOutStep:
    deltas: list[ChoiceDelta]  # one per choice that changed, in arrival order
    to_abort: list[str]  # engine ids a stop string finished here: abort them in the core
    to_submit: list[EngineRequest]  # siblings released by this step: send them to the core


@dataclass
class FanOut:
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    decoder: Any  # detokenizes: `decode(ids, skip_special_tokens)`
    block_size: int  # KV block size of the core: shorter prompts have no block to share
    priority: int = 0
    arrival_time: float = 0.0
    cache_salt: str | None = None
    slo: RequestSlo = DEFAULT_SLO  # tenant and SLO class, stamped on every engine request
    kv_transfer: KVTransferParams | None = None  # disaggregation (one choice only: the API checks)
    lora_name: str | None = None  # the LoRA adapter every choice runs with (None: the base model)
    choices: list[Choice] = field(default_factory=list)
    _by_engine_id: dict[str, Choice] = field(default_factory=dict)
    _siblings: dict[int, list[Choice]] = field(default_factory=dict)  # prompt index → choices not yet sent

    def __post_init__(self) -> None:
        n = self.params.n
        single = len(self.prompts) == 1 and n == 1
        for p in range(len(self.prompts)):
            for i in range(n):
                index = p * n + i
                engine_id = self.request_id if single else f"{self.request_id}-{index}"
                choice = Choice(index, p, engine_id, child_params(self.params, i))
                self.choices.append(choice)
                self._by_engine_id[engine_id] = choice

    @property
    def num_unfinished(self) -> int:
        return sum(1 for c in self.choices if not c.finished)

    @property
    def engine_ids(self) -> list[str]:
        return list(self._by_engine_id)

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Prompt tokens the prefix cache served, once per prompt (its first choice's count,
        as usage counts each prompt once however many choices share it)."""
        n = self.params.n
        leaders = (self.choices[p * n].state for p in range(len(self.prompts)))
        return sum(state.num_cached_tokens for state in leaders if state is not None)

    @property
    def error(self) -> str | None:
        """The engine's error, if any choice failed."""
        return next((c.state.error for c in self.choices if c.state is not None and c.state.error), None)

    def choice_for(self, engine_id: str) -> Choice:
        return self._by_engine_id[engine_id]

    def first_requests(self) -> list[EngineRequest]:
        """Every prompt's first choice, and the siblings that cannot share blocks. Call once."""
        n = self.params.n
        requests: list[EngineRequest] = []
        for p, prompt in enumerate(self.prompts):
            group = self.choices[p * n : (p + 1) * n]
            if n > 1 and len(prompt) >= self.block_size:
                self._siblings[p] = group[1:]
                group = group[:1]
            requests.extend(self._engine_request(choice) for choice in group)
        return requests

    def process(self, outputs: list[EngineOutput]) -> FanOutStep:
        """Fold core outputs of this request's choices in; unknown or late ones are ignored."""
        merged: dict[int, ChoiceDelta] = {}  # coalesced: one delta per choice
        to_abort: list[str] = []
        for output in outputs:
            choice = self._by_engine_id.get(output.request_id)
            if choice is None or choice.finished or choice.state is None:
                continue  # not ours, finished here already (stop string), or never sent
            delta = choice.state.apply(output)
            if delta.stopped_by_string:
                to_abort.append(choice.engine_id)
            if delta.finish_reason is not None:
                choice.finished = True
            previous = merged.get(choice.index)
            if previous is None:
                merged[choice.index] = ChoiceDelta(
                    choice, delta.new_text, list(delta.new_token_ids), list(delta.new_logprobs or []) or None,
                    delta.finish_reason, delta.stop_reason, delta.error,
                )  # fmt: skip
            else:
                previous.text += delta.new_text
                previous.token_ids.extend(delta.new_token_ids)
                if delta.new_logprobs:
                    previous.logprobs = (previous.logprobs or []) + list(delta.new_logprobs)
                previous.finish_reason, previous.stop_reason = delta.finish_reason, delta.stop_reason
                previous.error = previous.error or delta.error
        return FanOutStep(list(merged.values()), to_abort, self._release_siblings())

    def close(self) -> list[Choice]:
        """Mark every choice finished; returns those that were still live in the core (abort them)."""
        self._siblings.clear()
        live = [c for c in self.choices if not c.finished and c.state is not None]
        for choice in self.choices:
            choice.finished = True
        return live

    def _release_siblings(self) -> list[EngineRequest]:
        """A prompt's waiting siblings, once its first choice computed the prompt (or ended)."""
        released: list[EngineRequest] = []
        n = self.params.n
        for p in list(self._siblings):
            leader = self.choices[p * n]
            state = leader.state
            if not leader.finished and (state is None or not state.output_token_ids):
                continue
            for choice in self._siblings.pop(p):
                if state is not None and state.error:
                    choice.finished = True  # the engine failed: the leader's error answers for all
                else:
                    released.append(self._engine_request(choice))
        return released

    def _engine_request(self, choice: Choice) -> EngineRequest:
        prompt = self.prompts[choice.prompt_index]
        choice.state = RequestState.create(choice.engine_id, prompt, choice.params, self.decoder)
        return EngineRequest(
            request_id=choice.engine_id,
            prompt_token_ids=prompt,
            sampling_params=choice.params,
            priority=self.priority,
            arrival_time=self.arrival_time,
            cache_salt=self.cache_salt,
            slo=self.slo,
            kv_transfer=self.kv_transfer,
            lora_name=self.lora_name,
        )


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n: one engine request each; seeds differ (seed + index) or all n would be equal;
    only the first scores the prompt (prompt logprobs bypass the prefix cache its siblings hit)."""
    changes: dict[str, Any] = {"n": 1}
    if params.seed is not None and index > 0:
        # Wrapped so a seed near 2^63 still gives int64 seeds (every smaller seed is unchanged).
        changes["seed"] = (params.seed + index + 2**63) % 2**64 - 2**63
    if index > 0 and params.prompt_logprobs is not None:
        changes["prompt_logprobs"] = None
    return msgspec.structs.replace(params, **changes)
