"""API-side accumulation of engine outputs: token ids → text, stop strings, finished results.

One `RequestState` per engine request. A stop string is found here, not in the core
(the core never sees text), so when one matches, `process` reports the request id for
the caller to abort in the core: that is what frees its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelm.datatypes import EngineOutput, FinishReason, PositionLogprobs, RequestEvent
from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.sampling_params import SamplingParams


@dataclass
class CompletionDelta:
    """What one engine output added to one request, after detokenization."""

    request_id: str
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None  # the stop token id or stop string
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    events: list[RequestEvent] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestState:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        detokenizer = IncrementalDetokenizer(
            tokenizer=self.tokenizer,
            stop=list(params.stop),
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        state = RequestState(request_id, list(prompt_token_ids), params, detokenizer)
        self.requests[request_id] = state
        return state

    def process(self, outputs: list[EngineOutput]) -> tuple[list[CompletionDelta], list[str]]:
        """Fold outputs in; return the deltas and the ids a stop string finished (abort them in the core)."""
        deltas: list[CompletionDelta] = []
        stopped_by_string: list[str] = []
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is None or state.finished:
                continue  # already finished here (stop string), or never ours
            delta = self._apply(state, output)
            if delta.stop_reason is not None and isinstance(delta.stop_reason, str) and output.finish_reason is None:
                stopped_by_string.append(state.request_id)
            if state.finished:
                self.requests.pop(state.request_id, None)
            deltas.append(delta)
        return deltas, stopped_by_string

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def _apply(self, state: RequestState, output: EngineOutput) -> CompletionDelta:
        finished = output.finish_reason is not None
        update = state.detokenizer.add_tokens(output.new_token_ids, finished=finished)
        new_ids = list(output.new_token_ids)
        finish_reason = output.finish_reason.value if output.finish_reason is not None else None
        stop_reason: int | str | None = output.stop_reason
        if update.stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP.value, update.stop_string
        state.output_token_ids.extend(new_ids)
        state.text += update.new_text
        if output.new_logprobs:
            state.logprobs.extend(output.new_logprobs)
        if output.prompt_logprobs:
            state.prompt_logprobs.extend(output.prompt_logprobs)
        state.events.extend(output.events)
        state.num_cached_tokens = max(state.num_cached_tokens, output.num_cached_tokens)
        state.finish_reason, state.stop_reason, state.error = finish_reason, stop_reason, output.error
        return CompletionDelta(
            request_id=state.request_id,
            new_text=update.new_text,
            new_token_ids=new_ids,
            new_logprobs=output.new_logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            prompt_logprobs=output.prompt_logprobs,
            error=output.error,
        )
