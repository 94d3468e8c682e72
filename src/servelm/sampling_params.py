"""SamplingParams: how one request's next tokens are chosen. Crosses the API → core boundary.

Semantics follow vLLM / OpenAI:
- temperature == 0 means greedy (argmax), whatever the other knobs say.
- top_k <= 0 (or >= vocab) disables top-k; top_p == 1 disables top-p; min_p == 0 disables min-p.
- repetition_penalty (HF/CTRL style, multiplicative on logits of tokens seen in prompt or output),
  presence_penalty and frequency_penalty (OpenAI style, additive, over output tokens only).
- seed: same seed → same output, whatever else shares the batch.
- logprobs: number of top alternatives to return per sampled token (0 = only the sampled one's).
- prompt_logprobs: the same for prompt tokens (needed for `echo` + loglikelihood evaluation).

Every number must be finite and every int must fit a signed 64-bit integer: the struct crosses
the API → core boundary as msgspec (int64/uint64 only) and becomes torch tensors and generator
seeds there. Upper bounds on the floats keep the sampler's float32 arithmetic finite.
"""

from __future__ import annotations

import math

import msgspec

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEMPERATURE = 100.0  # beyond this the distribution is uniform in float32 anyway
MAX_REPETITION_PENALTY = 100.0  # logits x penalty must stay finite in float32
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
MAX_STRUCTURED_CHARS = 1 << 20  # a schema or grammar; the API bounds the whole body anyway


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter and the bound."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StructuredSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a request's output must match (servelm.structured enforces it, token by token).

    kind "json": `text` is a JSON Schema (serialised; '{"type": "object"}' for any JSON object);
    "regex": a regular expression; "choice": a JSON list of the strings allowed; "grammar": a
    context-free grammar (Lark or GBNF)."""

    kind: str
    text: str


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Speculative decoding for this request: None = the server's setting (its controller decides),
    # 0 = never, n > 0 = at most n draft tokens per step (the server's maximum still bounds it).
    num_speculative_tokens: int | None = None
    # Constrained decoding: every token is one the spec allows (None: free text).
    structured: StructuredSpec | None = None
    # The prompt's last n tokens are output that `structured` has already matched (the router's
    # continuation of a migrated stream): the grammar consumes them before the first sample.
    structured_resume_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamsError for the first out-of-range field."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise SamplingParamsError(name, f"{name} must be a finite number, got {value!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and not INT64_MIN <= value <= INT64_MAX:
                raise SamplingParamsError(name, f"{name} must fit a signed 64-bit integer, got {value}")
        bad_stop_id = next((t for t in self.stop_token_ids if not 0 <= t <= INT64_MAX), None)
        if bad_stop_id is not None:
            raise SamplingParamsError("stop_token_ids", f"stop_token_ids must be token ids (>= 0), got {bad_stop_id}")
        checks: list[tuple[str, bool, str]] = [
            ("n", self.n >= 1, "n must be at least 1"),
            ("temperature", self.temperature >= 0.0, "temperature must be >= 0"),
            ("temperature", self.temperature <= MAX_TEMPERATURE, f"temperature must be at most {MAX_TEMPERATURE:g}"),
            ("top_p", 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (
                "repetition_penalty",
                0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]",
            ),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must not exceed max_tokens",
            ),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs must be in [0, 20]",
            ),
            (
                "num_speculative_tokens",
                self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= 16,
                "num_speculative_tokens must be in [0, 16]",
            ),
            (
                "structured_resume_tokens",
                self.structured_resume_tokens == 0 or (self.structured_resume_tokens > 0 and self.structured is not None),
                "structured_resume_tokens must be >= 0, and needs a structured-output constraint",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamsError(param, f"{message}, got {getattr(self, param)!r}")
        spec = self.structured
        if spec is not None:
            if spec.kind not in STRUCTURED_KINDS:
                raise SamplingParamsError("structured", f"structured kind must be one of {STRUCTURED_KINDS}, got {spec.kind!r}")
            if not 0 < len(spec.text) <= MAX_STRUCTURED_CHARS:
                raise SamplingParamsError("structured", f"structured text must have 1 to {MAX_STRUCTURED_CHARS} characters")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_FIELDS = (
    "n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "num_speculative_tokens",
)  # fmt: skip
