"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping onto SamplingParams.

Strict on purpose: an unknown field or a value of the wrong type is a 400 naming the
parameter (a typo like `max_token` silently ignored is worse than an error). Hostile values
stop here too: every int must fit int64 (what msgspec carries to the core and torch accepts),
no float may be inf or NaN (`1e999` parses as inf), short identifier strings are bounded, and every
list and dict stops at its first bad item (FAIL_FAST: pydantic otherwise builds one error per bad
item, and per union member: 4.7 GB and 9 s for a 30 MB prompt of 5M ids, measured). Beyond
OpenAI's fields we accept vLLM's common extensions (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, min_tokens, priority, ...) and our own `servelm` options.
Range checks live in SamplingParams (one place); their errors keep the parameter name.

Responses are built as plain dicts and encoded with msgspec: they are on the per-token
hot path, where constructing pydantic models would cost more than the JSON itself.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from servelm.openai_api.chat_messages import template_message
from servelm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, SamplingParamsError, StructuredSpec
from servelm.server.errors import bad_request
from servelm.server.structured_request import ResponseFormat, StructuredOutputs, structured_spec
from servelm.server.tools import (
    MAX_TOOLS,
    ToolCallBody,
    ToolChoice,
    ToolDefinition,
    ToolMode,
    check_tools,
    tool_mode,
    tool_spec,
    tools_for_template,
)

MAX_N = 128  # choices per request; each one is an engine request
MAX_TOP_LOGPROBS = 20
MAX_ID_CHARS = 1024  # model, user, cache_salt, name: identifiers, never text to process
MAX_STOP_CHARS = 1024  # each stop string is matched against the text's tail at every token
MAX_STOPS = 64

FAIL_FAST = Field(fail_fast=True)
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Identifier = Annotated[str, Field(max_length=MAX_ID_CHARS)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_not_given(cls, data: Any) -> Any:
        # OpenAI's optional parameters are nullable and several SDKs send explicit nulls
        # ("n": null, "stop": null): null takes the default, as with OpenAI and vLLM.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class ServelmOptions(_Strict):
    """Our own request options, under `"servelm": {...}` (the openai client: `extra_body=`)."""

    timeline: bool = False  # return the request's timeline and TTFT split in the response
    # The prompt's last n tokens are output already held to this request's response_format or
    # structured_outputs: the router sets it when it continues a migrated stream on another replica.
    structured_resume_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0


class KVTransferParamsBody(_Strict):
    """`kv_transfer_params` (vLLM's field): one side of a prefill/decode hand-off, sent by the
    router (server/kv_transfer_api.py checks it against the server's --kv-role)."""

    do_remote_decode: bool = False  # prefill here; a decode server pulls the KV
    do_remote_prefill: bool = False  # pull the prompt's KV from remote_address, then decode here
    transfer_id: Identifier
    remote_address: Identifier | None = None


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Identifier | None = None  # None: the one served model
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None  # int64: torch.Generator.manual_seed's range, and seed + i stays in it (fan_out)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS, fail_fast=True)] | None = None
    stop_token_ids: Annotated[list[Int64], FAIL_FAST] | None = None  # within the vocabulary: checked by the engine front
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    priority: Int64 = 0  # lower runs first; 0 interactive, larger = batch
    user: Identifier | None = None
    # Prefix-cache namespace (vLLM's name): requests share cached KV only with the same salt,
    # so one tenant cannot learn from cache timing what another tenant's prompts were.
    cache_salt: Identifier | None = None
    logit_bias: Annotated[dict[str, float], FAIL_FAST] | None = None  # accepted only empty: not supported
    # Speculative decoding for this request (ours): false = never, true/absent = the server's
    # setting, n = at most n draft tokens per step. No effect on a server without speculation.
    speculative: bool | Int64 | None = None
    # How long this request's KV stays in the host/disk tiers (ours): "high" for a system prompt or
    # a document many requests will share, "low" for a one-off; absent: its SLO class's (normal).
    kv_retention: Literal["low", "normal", "high"] | None = None
    kv_transfer_params: KVTransferParamsBody | None = None
    # vLLM's: the prompt's token ids with the first chunk (or the response) and each choice's new ids
    # in every chunk, as the last fields (completions: per choice; chat: the prompt's at the top
    # level). The router asks for them to continue a stream on another replica (router/relay.py).
    return_token_ids: bool = False
    servelm: ServelmOptions | None = None
    # What the output must match (structured_request.py): OpenAI's field, or vLLM's.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def structured_param(self) -> str:
        """The field a structured-output error names."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def wants_timeline(self) -> bool:
        return self.servelm is not None and self.servelm.timeline

    def check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt must be a non-empty string when given", param="cache_salt")

    def sampling_params(
        self, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None, max_tokens_param: str
    ) -> SamplingParams:
        """The engine's SamplingParams; a range error becomes a 400 naming the API parameter."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", param="stop")
        given: dict[str, Any] = {  # the knobs a client may leave out (None: the engine default)
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        try:
            return SamplingParams(
                n=self.n,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                num_speculative_tokens=self._num_speculative_tokens,
                structured=structured_spec(self.response_format, self.structured_outputs),
                structured_resume_tokens=self.servelm.structured_resume_tokens if self.servelm is not None else 0,
                **{k: v for k, v in given.items() if v is not None},
            )
        except SamplingParamsError as exc:
            if exc.param == "num_speculative_tokens":
                raise bad_request(
                    f"speculative must be true, false or 0..16, got {self.speculative}", param="speculative"
                ) from exc
            # Chat names its limit max_completion_tokens: say what the client sent.
            param = max_tokens_param if exc.param == "max_tokens" else exc.param
            raise bad_request(str(exc).replace("max_tokens", max_tokens_param), param=param) from exc

    @property
    def _num_speculative_tokens(self) -> int | None:
        if self.speculative is None or self.speculative is True:
            return None
        return 0 if self.speculative is False else int(self.speculative)


class CompletionRequest(_GenerationRequest):
    # A string, several strings, one token-id list, or several (lm-eval sends batches of ids).
    prompt: (
        str | Annotated[list[str], FAIL_FAST] | Annotated[list[int], FAIL_FAST]
        | Annotated[list[Annotated[list[int], FAIL_FAST]], FAIL_FAST]
    )  # fmt: skip
    max_tokens: Int64 | None = 16
    echo: bool = False
    logprobs: Int64 | None = None  # top alternatives per token (0: only the chosen token's)
    suffix: str | None = None  # not supported
    best_of: Int64 | None = None  # accepted only when equal to n

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise bad_request("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (it may only equal n)", param="best_of")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad_request(f"max_tokens must be >= 0, got {self.max_tokens}", param="max_tokens")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens may be 0 only with echo (prompt scoring)", param="max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", param="logprobs")

    def to_sampling_params(self) -> SamplingParams:
        # max_tokens 0 + echo scores the prompt: the engine runs one token, the handler drops it.
        engine_max = 1 if self.max_tokens == 0 else self.max_tokens
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self.sampling_params(
            max_tokens=engine_max,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
            max_tokens_param="max_tokens",
        )


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only for an assistant message (check_contents); a list of at least one text part.
    content: str | Annotated[list[TextPart], Field(min_length=1, fail_fast=True)] | None = None
    name: Identifier | None = None
    # A tool-calling client's history: an assistant's calls, a tool result's call id (tools.py);
    # `refusal` and `annotations` are what an earlier response message had.
    tool_call_id: Identifier | None = None
    tool_calls: Annotated[list[ToolCallBody], FAIL_FAST] | None = None
    refusal: str | None = None
    annotations: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None

    def template_entry(self) -> dict[str, Any]:
        """The message as the chat template expects it (the router builds the same from raw JSON)."""
        content = self.content if not isinstance(self.content, list) else [part.text for part in self.content]
        calls = [call.model_dump() for call in self.tool_calls] if self.tool_calls else None
        return template_message(self.role, content, self.name, calls, self.tool_call_id)


def check_contents(messages: list[ChatMessage]) -> None:
    """OpenAI's rule: only an assistant message may omit its content (one that made tool calls),
    and only an assistant message carries tool calls."""
    for index, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise bad_request(
                f"messages[{index}]: only an assistant message carries tool_calls", param=f"messages.{index}.tool_calls"
            )
        if message.content is None and message.role != "assistant":
            raise bad_request(
                f"messages[{index}]: a {message.role} message must have content", param=f"messages.{index}.content"
            )


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    # Function tools (tools.py); parallel_tool_calls: None is true, as OpenAI's default.
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted so clients that always send them work; only their no-op values are served.
    functions: Annotated[list[dict[str, Any]], FAIL_FAST] | None = None  # OpenAI's older tools: only empty
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    # OpenAI's parameters that change nothing a server like this one generates: accepted, and
    # ignored (storing completions, their metadata, a billing tier, a predicted output to speed up).
    store: bool | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    service_tier: Identifier | None = None
    prediction: dict[str, Any] | None = None
    modalities: Annotated[list[Literal["text", "audio"]], FAIL_FAST] | None = None  # "text" only (check)

    def check(self) -> None:
        self.check_common()
        check_contents(self.messages)
        check_tools(self.tools, self.tool_choice)
        if self._tool_spec() is not None and (self.response_format is not None or self.structured_outputs is not None):
            raise bad_request(
                "a required or named tool_choice holds the output to the tool's arguments: drop response_format "
                "and structured_outputs", param="tool_choice",
            )  # fmt: skip
        if self.functions:
            raise bad_request("functions are not supported by this server (no tool calling)", param="functions")
        if isinstance(self.function_call, dict):
            raise bad_request('function_call may only be "none" or "auto": no tool calling here', param="function_call")
        if self.modalities is not None and self.modalities != ["text"]:
            raise bad_request('modalities may only be ["text"]: this server generates text', param="modalities")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", param="top_logprobs"
                )

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.sampling_params(
            max_tokens=limit, logprobs=logprobs, prompt_logprobs=None, max_tokens_param=self.max_tokens_param
        )
        spec = self._tool_spec()
        return msgspec.structs.replace(params, structured=spec) if spec is not None else params

    def tool_mode(self, parser: str | None) -> ToolMode:
        """How the output is read (tools.py); `parser`: the server's --tool-call-parser for auto."""
        return tool_mode(self.tools, self.tool_choice, parser)

    def _tool_spec(self) -> StructuredSpec | None:
        return tool_spec(self.tool_mode(None), self.tools, self.parallel_tool_calls is not False)

    @property
    def structured_param(self) -> str:
        if self._tool_spec() is not None:
            return "tools"
        return super().structured_param

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return tools_for_template(self.tools)

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them."""
        return [message.template_entry() for message in self.messages]


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered by the chat template."""

    model: Identifier | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], FAIL_FAST] | None = None
    add_special_tokens: bool = True  # prompt only: the chat template writes its own
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        if self.messages is not None:
            check_contents(self.messages)


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape): token ids → text."""

    model: Identifier | None = None
    tokens: Annotated[list[int], FAIL_FAST]  # within the vocabulary: checked by the engine front
    # True: special tokens' text left out, as a stream shows it (the router joins a migrated stream's
    # text with it); False (default): every token's text.
    skip_special_tokens: bool = False


class LoadLoRAAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's shape): serve the PEFT adapter at `lora_path` (a path on
    the server) as the model `lora_name`."""

    lora_name: Identifier
    lora_path: Annotated[str, Field(min_length=1)]
    base_model_name: Identifier | None = None  # what /v1/models lists as its parent (None: the served model)
    lora_int_id: int | None = None  # vLLM's clients may send it; names are what servelm goes by


class UnloadLoRAAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's shape)."""

    lora_name: Identifier
    lora_int_id: int | None = None

