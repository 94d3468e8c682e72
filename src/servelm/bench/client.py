"""One streamed request over HTTP, measured: what every OpenAI-compatible server understands.

We send a text prompt to /v1/completions (or one user message, or a request's whole chat
history, to /v1/chat/completions) with
`stream: true` and `stream_options.include_usage`, and read the SSE stream chunk by chunk:

    sent ── first chunk with text (TTFT) ── chunk ── chunk ── ... ── [DONE] (E2E)
                                  └ gap ┘   └ gap ┘            (inter-token gaps: TBT)

A chunk may carry more than one token (a server may coalesce); gaps are between chunks, as
in vLLM's and SGLang's benchmarks. Token counts come from the final `usage`; a server that
sends none gets its text tokenized here. servelm-only fields (priority, ignore_eos, the
timeline with the TTFT breakdown) are sent only when the config asks for them, because a
strict server rejects fields it does not know.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from servelm.bench.slow_reader import SlowReading
from servelm.bench.tokens import TokenSource
from servelm.bench.workload import WorkloadRequest


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"  # completions | chat
    temperature: float = 0.0
    ignore_eos: bool = True  # outputs run to max_tokens: lengths as the workload says (vLLM, SGLang, servelm)
    # Also send min_tokens = max_tokens: the same lengths from a server without ignore_eos
    # (llama-cpp-python bans EOS until then; servelm and vLLM take either field).
    send_min_tokens: bool = False
    send_priority: bool = False  # the `priority` field (servelm; vLLM only with --scheduling-policy priority)
    want_timeline: bool = False  # servelm's per-request timeline, with the TTFT breakdown
    api_key: str | None = None  # every request's, unless its traffic class has its own in api_keys
    request_timeout_s: float = 600.0
    api_keys: dict[str, str] = field(default_factory=dict)  # traffic class → its key (a server's tenant)
    slow_reading: SlowReading | None = None  # how requests marked slow_reader read (None: like the rest)
    slow_reader_logprobs: int = 0  # top logprobs per token those requests ask for: heavier chunks
    keep_output_text: bool = False  # records keep the streamed text (to compare outputs between servers)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if self.slow_reader_logprobs < 0:
            raise ValueError(f"slow_reader_logprobs must be >= 0, got {self.slow_reader_logprobs}")

    def is_chat(self, request: WorkloadRequest) -> bool:
        return self.endpoint == "chat" or request.messages is not None

    def headers_for(self, traffic_class: str) -> dict[str, str]:
        """The class's own Authorization header; empty: the HTTP client's default (`api_key`) applies."""
        key = self.api_keys.get(traffic_class)
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class RequestRecord:
    """Everything measured about one request. Times are seconds after the run started."""

    index: int
    traffic_class: str
    priority: int
    session_id: str | None
    max_tokens: int
    expected_prompt_tokens: int  # what the workload built (exact for /v1/completions)
    shared_prefix_tokens: int
    scheduled_s: float  # when it was due: its arrival time, or when its session / closed-loop slot freed
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # each chunk that carried text
    num_prompt_tokens: int | None = None
    num_output_tokens: int | None = None
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    token_source: str = "usage"  # usage | tokenizer
    status: str = "pending"  # ok | error | cancelled (cut by the wall-clock limit or Ctrl-C)
    error: str | None = None
    finish_reason: str | None = None
    ttft_breakdown_s: dict[str, float] | None = None  # servelm's split of TTFT, seconds
    slow_reader: bool = False  # read its stream slowly (see bench.slow_reader)
    output_text: str | None = None  # the whole streamed text, when ClientConfig.keep_output_text

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None or self.sent_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None or self.sent_s is None else self.end_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1): decode time per token after the first."""
        if self.ttft_s is None or self.e2e_s is None or not self.num_output_tokens or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ttft_s=self.ttft_s, e2e_s=self.e2e_s, tpot_s=self.tpot_s)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in raw.items() if k in names})


def request_body(config: ClientConfig, request: WorkloadRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": request.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.model is not None:
        body["model"] = config.model
    chat = config.is_chat(request)
    if request.messages is not None:
        body["messages"] = request.messages
    elif chat:
        body["messages"] = [{"role": "user", "content": request.prompt_text}]
    else:
        body["prompt"] = request.prompt_text
    if request.slow_reader and config.slow_reader_logprobs:
        body.update({"logprobs": True, "top_logprobs": config.slow_reader_logprobs} if chat
                    else {"logprobs": config.slow_reader_logprobs})  # fmt: skip
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.send_min_tokens:
        body["min_tokens"] = request.max_tokens
    if config.send_priority:
        body["priority"] = request.priority
    if config.want_timeline:
        body["servelm"] = {"timeline": True}
    return body


@dataclass
class _Stream:
    """What the chunks said so far."""

    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    breakdown_ms: dict[str, float] | None = None
    error: str | None = None


def _read_chunk(chunk: dict[str, Any], stream: _Stream, chat: bool) -> str:
    """Fold one parsed SSE chunk into `stream`; returns the text it carried."""
    if "error" in chunk:
        error = chunk["error"]
        stream.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        return ""
    if chunk.get("usage"):
        stream.usage = chunk["usage"]
    timeline = (chunk.get("servelm") or {}).get("timeline")
    if timeline and timeline.get("ttft_breakdown_ms"):
        stream.breakdown_ms = timeline["ttft_breakdown_ms"]
    text = ""
    for choice in chunk.get("choices") or []:
        text += ((choice.get("delta") or {}).get("content") or "") if chat else (choice.get("text") or "")
        stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    if text:
        stream.text.append(text)
    return text


async def send_request(
    http: httpx.AsyncClient,
    config: ClientConfig,
    request: WorkloadRequest,
    record: RequestRecord,
    clock: Callable[[], float],
    tokens: TokenSource | None,
    keep_text: bool = False,
) -> RequestRecord:
    """Send `request`, filling `record` as chunks arrive (so a cancelled request keeps what it got).
    The record keeps the streamed text with `keep_text` or the config's `keep_output_text`."""
    chat = config.is_chat(request)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    stream = _Stream()
    record.sent_s = clock()
    try:
        headers = config.headers_for(request.traffic_class)
        async with http.stream("POST", path, json=request_body(config, request), headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return _failed(record, clock(), f"HTTP {response.status_code}: {body[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if _read_chunk(json.loads(data), stream, chat):
                    now = clock()
                    record.first_token_s = now if record.first_token_s is None else record.first_token_s
                    record.chunk_times_s.append(now)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return _failed(record, clock(), f"{type(exc).__name__}: {exc}")
    record.end_s = clock()
    if stream.error is not None:
        return _failed(record, record.end_s, stream.error)
    _count_tokens(record, request, stream, tokens, chat)
    record.finish_reason = stream.finish_reason
    if config.keep_output_text or keep_text:
        record.output_text = "".join(stream.text)
    if stream.breakdown_ms:
        record.ttft_breakdown_s = {k: v / 1000.0 for k, v in stream.breakdown_ms.items()}
    record.status = "ok" if record.first_token_s is not None else "error"
    record.error = None if record.ok else "the stream ended without any text"
    return record


def _count_tokens(record: RequestRecord, request: WorkloadRequest, stream: _Stream,
                  tokens: TokenSource | None, chat: bool) -> None:  # fmt: skip
    usage = stream.usage or {}
    if "prompt_tokens" in usage and "completion_tokens" in usage:
        record.num_prompt_tokens = int(usage["prompt_tokens"])
        record.num_output_tokens = int(usage["completion_tokens"])
        record.token_source = "usage"
        details = usage.get("prompt_tokens_details") or {}  # vLLM sends it only with --enable-prompt-tokens-details
        if details.get("cached_tokens") is not None:
            record.num_cached_tokens = int(details["cached_tokens"])
        return
    # No usage: count here. Exact for a completions prompt (built that way) and for an output that
    # ended for length (max_tokens of them: re-tokenizing the text can merge tokens); otherwise,
    # and for a chat prompt (whose template we do not see), our tokenizer's count of the text.
    record.token_source = "tokenizer"
    record.num_prompt_tokens = request.num_prompt_tokens
    if chat and tokens is not None:
        record.num_prompt_tokens = tokens.count(request.prompt_text)
    if stream.finish_reason == "length":
        record.num_output_tokens = request.max_tokens
    elif tokens is not None:
        record.num_output_tokens = tokens.count("".join(stream.text))
    else:
        record.num_output_tokens = len(record.chunk_times_s)


def _failed(record: RequestRecord, now: float, message: str) -> RequestRecord:
    record.end_s = now
    record.status = "error"
    record.error = message
    return record
