"""One engine request's output as the caller sees it: token ids → text, stop strings, logprobs.

The core never sees text, so a stop string is found here: when one matches, the delta says
so (`stopped_by_string`) and the owner of the request aborts it in the core, which is what
frees its blocks. Each `RequestState` belongs to exactly one fan-out (engine/fan_out.py):
states are never shared or looked up by id across requests.
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

    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None  # the stop token id or stop string
    error: str | None = None
    # A stop string ended it here while the core still runs it: abort it in the core.
    stopped_by_string: bool = False


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

    @classmethod
    def create(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, decoder: Any) -> RequestState:
        """`decoder`: anything with `decode(ids, skip_special_tokens)` (a tokenizer or a FastDecoder)."""
        detokenizer = IncrementalDetokenizer(
            tokenizer=decoder,
            stop=list(params.stop),
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            min_tokens=params.min_tokens,
        )
        return cls(request_id, list(prompt_token_ids), params, detokenizer)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, output: EngineOutput) -> CompletionDelta:
        """Fold one engine output in (the caller skips outputs that arrive after it finished)."""
        finished = output.finish_reason is not None
        update = self.detokenizer.add_tokens(output.new_token_ids, finished=finished)
        new_ids = list(output.new_token_ids)
        finish_reason = output.finish_reason.value if output.finish_reason is not None else None
        stop_reason: int | str | None = output.stop_reason
        stopped_by_string = update.stop_string is not None and not finished
        if update.stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP.value, update.stop_string
        self.output_token_ids.extend(new_ids)
        self.text += update.new_text
        if output.new_logprobs:
            self.logprobs.extend(output.new_logprobs)
        if output.prompt_logprobs:
            self.prompt_logprobs.extend(output.prompt_logprobs)
        self.events.extend(output.events)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        self.finish_reason, self.stop_reason, self.error = finish_reason, stop_reason, output.error
        return CompletionDelta(
            new_text=update.new_text,
            new_token_ids=new_ids,
            new_logprobs=output.new_logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            error=output.error,
            stopped_by_string=stopped_by_string,
        )
