"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, the same engine in-process.

All prompts are added at once and stepped to completion, so they batch exactly as
concurrent server traffic would. `n > 1` becomes n engine requests with the same
prompt; after the first computes it, the others find its full blocks in the prefix cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest, PositionLogprobs
from servelm.engine.builder import BuiltEngine, build_engine
from servelm.engine.output_processor import OutputProcessor, RequestState
from servelm.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    events: list = field(default_factory=list)


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **overrides: Any) -> None:
        """`model`: a HF directory or .gguf (None: the default model). Keyword overrides go to the
        config slice that owns them, e.g. dtype="float32", num_blocks=256, max_num_batched_tokens=512."""
        self.config = config or EngineConfig.from_flat(model=model, **overrides)
        self.engine: BuiltEngine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results in the order of `prompts`."""
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        processor = OutputProcessor(self.tokenizer)
        states: dict[str, RequestState] = {}  # every sub-request's state; it stays filled in after finishing
        order: list[tuple[str, str | None, list[int], list[str]]] = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            text, token_ids = (prompt, self.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
            self._check_length(token_ids)
            request_id = f"offline-{next(self._ids)}"
            sub_ids = [request_id if params.n == 1 else f"{request_id}-{k}" for k in range(params.n)]
            for sub_id in sub_ids:
                states[sub_id] = processor.add_request(sub_id, token_ids, params)
                self.engine.core.add_request(
                    EngineRequest(
                        request_id=sub_id,
                        prompt_token_ids=token_ids,
                        sampling_params=params,
                        priority=priority[i] if priority else 0,
                    )
                )
            order.append((request_id, text, token_ids, sub_ids))
        self._run_to_completion(processor)
        return [self._to_output(rid, text, ids, [states[s] for s in subs]) for rid, text, ids, subs in order]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for a reply."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def _run_to_completion(self, processor: OutputProcessor) -> None:
        """Step until the core is idle; each RequestState accumulates its own request's output."""
        core = self.engine.core
        while core.has_work():
            _, stopped = processor.process(core.step())
            if stopped:
                core.abort_requests(stopped)

    def _check_length(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(token_ids) >= self.engine.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the context window is {self.engine.max_model_len}"
            )

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int):
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts")
        return list(params)

    @staticmethod
    def _to_output(request_id: str, text: str | None, token_ids: list[int], states: list[RequestState]) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            outputs=[
                CompletionOutput(
                    index=k,
                    text=s.text,
                    token_ids=s.output_token_ids,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=s.logprobs if s.params.logprobs is not None else None,
                )
                for k, s in enumerate(states)
            ],
            prompt_logprobs=states[0].prompt_logprobs if states[0].params.prompt_logprobs is not None else None,
            num_cached_tokens=states[0].num_cached_tokens,
            events=states[0].events,
        )
