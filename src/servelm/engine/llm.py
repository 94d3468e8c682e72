"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, the same engine in-process.

All prompts are added at once and stepped to completion, so they batch exactly as
concurrent server traffic would. `n > 1` goes through the same fan-out as the server
(engine/fan_out.py): per-choice seeds, and siblings sent once the first choice has
computed the prompt, so they find its full blocks in the prefix cache.

Inputs are checked before anything reaches the core (prompt forms: engine/prompt_inputs.py;
ids within the vocabulary; SamplingParams). A request that still fails inside a step fails
alone (EngineCore.step); generate() then raises RequestFailedError once every other request
of the call has finished, so the core is empty and the same LLM serves the next call.

`shutdown()` (or leaving `with LLM(...) as llm:`, or deleting it) stops the engine: the KV tiers'
last saves, a multi-rank engine's follower processes and this process's place in their process
group, so a second parallel LLM can start in the same process (a notebook, a test suite).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from servelm.config import EngineConfig
from servelm.datatypes import EngineOutput, PositionLogprobs, RequestEvent
from servelm.engine.builder import BuiltEngine, build_engine
from servelm.engine.fan_out import FanOut
from servelm.engine.prompt_inputs import PromptInput, parse_prompts
from servelm.sampling_params import SamplingParams
from servelm.tokenization.chat_roles import developer_as_system


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
    events: list[RequestEvent] = field(default_factory=list)


class RequestFailedError(RuntimeError):
    """A request failed inside an engine step (the engine logged the traceback); the LLM is still usable."""


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **overrides: Any) -> None:
        """`model`: a HF directory or .gguf (None: the default model). Keyword overrides go to the
        config slice that owns them, e.g. dtype="float32", num_blocks=256, max_num_batched_tokens=512."""
        self.config = config or EngineConfig.from_flat(model=model, **overrides)
        self.engine: BuiltEngine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._shut_down = False

    def shutdown(self) -> None:
        """Stop the engine (idempotent): its KV saves, its ranks and their process group. The LLM
        generates nothing after it."""
        if self._shut_down:
            return
        self._shut_down = True
        self.engine.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_shut_down", True):  # shut down already, or __init__ failed before the engine
            return
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - at interpreter exit, or mid-collection: nothing to tell
            pass

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results in the order of `prompts` (forms: prompt_inputs.py).
        `lora_name`: the LoRA adapter (of --lora-modules) every prompt runs with, or one per prompt
        (None: the base model). TypeError/ValueError for malformed input, before anything is sent;
        RequestFailedError when a request failed inside the engine."""
        if self._shut_down:
            raise RuntimeError("this LLM was shut down: create a new one")
        parsed = parse_prompts(prompts)
        params_list = self._params_per_prompt(sampling_params, len(parsed))
        if priority is not None and len(priority) != len(parsed):
            raise ValueError(f"{len(priority)} priorities for {len(parsed)} prompts")
        adapters = [lora_name] * len(parsed) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        if len(adapters) != len(parsed):
            raise ValueError(f"{len(adapters)} LoRA adapter names for {len(parsed)} prompts")
        served = {module.name for module in self.config.lora.lora_modules}
        for name in adapters:
            if name is not None and name not in served:
                raise ValueError(f"LoRA adapter {name!r} is not served (served: {sorted(served) or 'none'})")
        prepared: list[tuple[str | None, list[int]]] = []
        for i, (prompt, params) in enumerate(zip(parsed, params_list)):
            token_ids = self.encode(prompt.text) if prompt.text is not None else prompt.token_ids
            assert token_ids is not None
            self._check_prompt(i, token_ids, params)
            prepared.append((prompt.text, token_ids))
        fan_outs: list[tuple[str | None, FanOut]] = []
        for i, ((text, token_ids), params) in enumerate(zip(prepared, params_list)):
            fan_out = FanOut(
                request_id=f"offline-{next(self._ids)}",
                prompts=[token_ids],
                params=params,
                decoder=self.tokenizer,
                block_size=self.config.cache.block_size,
                priority=priority[i] if priority else 0,
                arrival_time=time.time(),
                lora_name=adapters[i],
            )
            fan_outs.append((text, fan_out))
        self._run_to_completion([fan_out for _, fan_out in fan_outs])
        failed = [fan_out for _, fan_out in fan_outs if fan_out.error is not None]
        if failed:
            raise RequestFailedError(
                f"{len(failed)} of {len(fan_outs)} requests failed in the engine "
                f"({failed[0].request_id}: {failed[0].error}); see the log for the traceback"
            )
        return [_to_output(text, fan_out) for text, fan_out in fan_outs]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for a reply."""
        messages = developer_as_system(messages, self.tokenizer.chat_template or "")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def _run_to_completion(self, fan_outs: list[FanOut]) -> None:
        """Send every fan-out's first requests, then step until the core is idle, feeding each
        fan-out its own outputs and sending the siblings it releases (the server's rules exactly)."""
        core = self.engine.core
        owner = {engine_id: fan_out for fan_out in fan_outs for engine_id in fan_out.engine_ids}
        for fan_out in fan_outs:
            for request in fan_out.first_requests():
                core.add_request(request)
        while core.has_work():
            by_owner: dict[str, list[EngineOutput]] = {}
            for output in core.step():
                by_owner.setdefault(owner[output.request_id].request_id, []).append(output)
            for fan_out in fan_outs:
                if fan_out.request_id not in by_owner:
                    continue
                step = fan_out.process(by_owner[fan_out.request_id])
                if step.to_abort:
                    core.abort_requests(step.to_abort)
                for request in step.to_submit:
                    core.add_request(request)

    def _check_prompt(self, index: int, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError(f"prompt {index} is empty: at least one token is needed")
        if len(token_ids) >= self.engine.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(token_ids)} tokens; the context window is {self.engine.max_model_len}"
            )
        if params.structured_resume_tokens >= len(token_ids):
            raise ValueError(f"prompt {index}: structured_resume_tokens must be fewer than its {len(token_ids)} tokens")
        vocab_size = self.engine.arch.vocab_size
        for name, ids in (("token id", token_ids), ("stop_token_ids entry", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt {index}: {name} {bad} is out of range: the vocabulary has {vocab_size} tokens")

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, one per prompt")
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts")
        return list(params)


def _to_output(text: str | None, fan_out: FanOut) -> RequestOutput:
    leader = fan_out.choices[0].state
    assert leader is not None, "the first choice is always sent"
    return RequestOutput(
        request_id=fan_out.request_id,
        prompt=text,
        prompt_token_ids=fan_out.prompts[0],
        outputs=[
            CompletionOutput(
                index=choice.index,
                text=choice.state.text,
                token_ids=choice.state.output_token_ids,
                finish_reason=choice.state.finish_reason,
                stop_reason=choice.state.stop_reason,
                logprobs=choice.state.logprobs if choice.state.params.logprobs is not None else None,
            )
            for choice in fan_out.choices
            if choice.state is not None
        ],
        prompt_logprobs=leader.prompt_logprobs if leader.params.prompt_logprobs is not None else None,
        num_cached_tokens=leader.num_cached_tokens,
        events=leader.events,
    )
