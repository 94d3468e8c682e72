"""Hostile requests against any OpenAI-compatible server, and a runner that scores the answers.

Each case is a request a client should never send: integers beyond 64 bits, non-finite floats,
megabyte strings with NUL or lone UTF-16 surrogates, oversize bodies, bodies that are not
declared JSON, a user message without content, prompts no context holds (8 MB of text, 1M token
ids, 100k messages), a list of 200k bad items. A hardened server answers each with a 4xx in
OpenAI's error shape, never a 5xx or a 2xx, and keeps the keep-alive connection usable: the
runner sends a normal request on the same connection right after each case.

Used by tests/server/test_hostile_requests.py (our server) and benchmarks/hostile_requests.py
(any base URL, e.g. vLLM). Bodies are built as raw bytes: `1e999`, `NaN` and `"\\ud800"` cannot
come out of a JSON encoder.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

INT_EDGES = {"-2^63-1": str(-(2**63) - 1), "2^63": str(2**63), "2^64": str(2**64), "2^100": str(2**100)}
FLOAT_EDGES = {"+inf": "1e999", "-inf": "-1e999", "nan": "NaN", "1e308": "1e308"}
MEGABYTE = 2**20
STRING_EDGES = {
    "1MB+NUL": json.dumps("hello \u0000 " * (MEGABYTE // 8)),
    "lone-surrogate": '"hello \\ud800 world"',
}
RAW = "\u0000RAW\u0000"  # placeholder replaced by the raw JSON text of the hostile value

COMPLETION = {"prompt": "Hello there", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass(frozen=True)
class HostileCase:
    name: str
    path: str
    body: bytes
    param: str | None  # the field the error must name (a prefix of `param`); None: not checked
    content_type: str | None = "application/json"

    def headers(self, extra: dict[str, str]) -> dict[str, str]:
        headers = dict(extra)
        if self.content_type is not None:
            headers["Content-Type"] = self.content_type
        return headers


def _with_raw(base: dict[str, Any], path: list[str | int], raw: str) -> bytes:
    """`base` as JSON with the value at `path` replaced by the raw JSON text `raw`."""
    body = json.loads(json.dumps(base))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = RAW
    return json.dumps(body).replace(json.dumps(RAW), raw).encode()


def _numeric_cases() -> list[HostileCase]:
    cases = []
    int_fields: list[tuple[str, dict[str, Any], list[str | int], str]] = [
        ("/v1/completions", COMPLETION, [name], name)
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "priority", "logprobs", "best_of")
    ]
    int_fields += [
        ("/v1/completions", {**COMPLETION, "stop_token_ids": [0]}, ["stop_token_ids", 0], "stop_token_ids"),
        ("/v1/completions", {**COMPLETION, "prompt": [1]}, ["prompt", 0], "prompt"),
        ("/v1/completions", {**COMPLETION, "stream": True}, ["seed"], "seed"),
        ("/v1/chat/completions", CHAT, ["seed"], "seed"),
        ("/v1/chat/completions", CHAT, ["top_k"], "top_k"),
        ("/v1/chat/completions", CHAT, ["max_completion_tokens"], "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True}, ["top_logprobs"], "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "stream": True}, ["stop_token_ids"], "stop_token_ids"),
        ("/detokenize", {"tokens": [1]}, ["tokens", 0], "tokens"),
    ]
    for path, base, where, param in int_fields:
        for label, raw in INT_EDGES.items():
            if where == ["stop_token_ids"]:
                raw = f"[{raw}]"
            cases.append(HostileCase(f"{path} {param}={label}", path, _with_raw(base, where, raw), param))
    float_fields: list[tuple[str, dict[str, Any], list[str | int], str]] = [
        ("/v1/completions", COMPLETION, [name], name)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    ]
    float_fields += [
        ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 0.0}}, ["logit_bias", "5"], "logit_bias"),
        ("/v1/chat/completions", CHAT, ["temperature"], "temperature"),
        ("/v1/chat/completions", {**CHAT, "stream": True}, ["top_p"], "top_p"),
    ]
    for path, base, where, param in float_fields:
        for label, raw in FLOAT_EDGES.items():
            cases.append(HostileCase(f"{path} {param}={label}", path, _with_raw(base, where, raw), param))
    return cases


def _string_cases() -> list[HostileCase]:
    fields: list[tuple[str, dict[str, Any], list[str | int], str]] = [
        ("/v1/completions", COMPLETION, ["prompt"], "prompt"),
        ("/v1/completions", COMPLETION, ["stop"], "stop"),
        ("/v1/completions", {**COMPLETION, "stop": ["x"]}, ["stop", 0], "stop"),
        ("/v1/completions", COMPLETION, ["user"], "user"),
        ("/v1/completions", COMPLETION, ["cache_salt"], "cache_salt"),
        ("/v1/completions", COMPLETION, ["model"], "model"),
        ("/v1/chat/completions", CHAT, ["messages", 0, "content"], "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "a"}]},
         ["messages", 0, "name"], "messages.0.name"),  # fmt: skip
    ]
    cases = []
    for path, base, where, param in fields:
        for label, raw in STRING_EDGES.items():
            cases.append(HostileCase(f"{path} {param}={label}", path, _with_raw(base, where, raw), param))
    # /tokenize answers a long valid prompt (that is its job); a lone surrogate is never valid.
    raw = STRING_EDGES["lone-surrogate"]
    cases.append(HostileCase("/tokenize prompt=lone-surrogate", "/tokenize", _with_raw({"prompt": "x"}, ["prompt"], raw), "prompt"))
    return cases


def _envelope_cases(max_body_bytes: int) -> list[HostileCase]:
    completion = json.dumps(COMPLETION).encode()
    cases = [
        HostileCase(f"{path} content-type={kind}", path, body, None, content_type=kind)
        for path, body in (("/v1/completions", completion), ("/v1/chat/completions", json.dumps(CHAT).encode()),
                           ("/tokenize", b'{"prompt": "hi"}'))  # fmt: skip
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None)
    ]
    oversize = _with_raw(COMPLETION, ["prompt"], json.dumps("a" * (max_body_bytes + MEGABYTE)))
    cases.append(HostileCase("/v1/completions oversize body", "/v1/completions", oversize, None))
    # Deeper than Python's own parser recurses (an outside probe: 500): invalid JSON, no field named.
    for depth in (1_000, 100_000):
        nested = "[" * depth + "]" * depth
        cases.append(HostileCase(f"/v1/chat/completions messages nested {depth} deep", "/v1/chat/completions",
                                 _with_raw(CHAT, ["messages"], nested), None))  # fmt: skip
        cases.append(HostileCase(f"/v1/completions unknown field nested {depth} deep", "/v1/completions",
                                 _with_raw({**COMPLETION, "extra": 0}, ["extra"], nested), None))  # fmt: skip
    no_content = {**CHAT, "messages": [{"role": "user"}]}
    cases.append(HostileCase("/v1/chat/completions user message without content", "/v1/chat/completions",
                             json.dumps(no_content).encode(), "messages"))  # fmt: skip
    return cases


def _size_cases() -> list[HostileCase]:
    """Prompts no context holds, within the body limit: to be refused without tokenizing them,
    and lists of bad items, to be refused at the first (not with one error object per item)."""
    ids = json.dumps({**COMPLETION, "prompt": [1000] * 1_000_000}).encode()
    text = _with_raw(COMPLETION, ["prompt"], json.dumps("hello " * (8 * MEGABYTE // 6)))
    many = json.dumps({**CHAT, "messages": [{"role": "user", "content": "hi"}] * 100_000}).encode()
    bad_items = _with_raw(COMPLETION, ["prompt"], "[1, " + ", ".join(['"x"'] * 200_000) + "]")
    return [
        HostileCase("/v1/completions prompt=8MB text", "/v1/completions", text, "prompt"),
        HostileCase("/v1/completions prompt=1M token ids", "/v1/completions", ids, "prompt"),
        HostileCase("/v1/chat/completions messages=100k", "/v1/chat/completions", many, "messages"),
        HostileCase("/v1/completions prompt=200k bad items", "/v1/completions", bad_items, "prompt"),
    ]


def hostile_cases(max_body_bytes: int = 32 * MEGABYTE) -> list[HostileCase]:
    """Every case; `max_body_bytes`: the server's body limit (the oversize case exceeds it by 1 MB)."""
    return _numeric_cases() + _string_cases() + _envelope_cases(max_body_bytes) + _size_cases()


@dataclass
class CaseResult:
    case: HostileCase
    status: int  # 0: no answer (connection error)
    error: dict[str, Any] | None  # the OpenAI error object, when the body had one
    follow_up_ok: bool  # a normal request right after, on the same connection (or a properly closed one), got 200
    detail: str = ""

    @property
    def outcome(self) -> str:
        """"4xx" | "5xx" | "2xx" (wrong: accepted) | "no-answer"."""
        if self.status == 0:
            return "no-answer"
        return f"{self.status // 100}xx" if self.status // 100 in (2, 4, 5) else str(self.status)

    @property
    def names_param(self) -> bool:
        expected = self.case.param
        given = (self.error or {}).get("param")
        return expected is None or (isinstance(given, str) and given.startswith(expected))


@dataclass
class HostileReport:
    results: list[CaseResult] = field(default_factory=list)

    @property
    def counts(self) -> Counter[str]:
        return Counter(r.outcome for r in self.results)

    @property
    def broken_connections(self) -> int:
        return sum(1 for r in self.results if not r.follow_up_ok)


class _Connection:
    """One keep-alive HTTP/1.1 connection; reopened only when the server said `Connection: close`."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout_s = timeout_s
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        self.conn.request(method, path, body=body, headers=headers)
        response = self.conn.getresponse()
        data = response.read()
        if response.getheader("connection", "").lower() == "close":
            self.conn.close()  # closed properly: the next request may open a new connection
        return response.status, data

    def reset(self) -> None:
        self.conn.close()
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)


def run_hostile(
    base_url: str, cases: list[HostileCase], model: str | None = None, api_key: str | None = None, timeout_s: float = 120
) -> HostileReport:
    """Send every case, each followed by a normal completion on the same connection."""
    extra = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    normal = json.dumps({**COMPLETION, **({"model": model} if model else {})}).encode()
    connection = _Connection(base_url, timeout_s)
    report = HostileReport()
    for case in cases:
        body = case.body
        if model and body.startswith(b"{") and b'"model":' not in body:
            body = b'{"model": ' + json.dumps(model).encode() + b", " + body[1:]
        try:
            status, data = connection.request("POST", case.path, body, case.headers(extra))
        except (OSError, http.client.HTTPException) as exc:
            report.results.append(CaseResult(case, 0, None, False, f"{type(exc).__name__}: {exc}"))
            connection.reset()
            continue
        error = _error_object(data)
        try:
            follow_status, follow_data = connection.request(
                "POST", "/v1/completions", normal, {**extra, "Content-Type": "application/json"}
            )
            follow_ok, detail = follow_status == 200, "" if follow_status == 200 else follow_data[:200].decode(errors="replace")
        except (OSError, http.client.HTTPException) as exc:
            follow_ok, detail = False, f"follow-up: {type(exc).__name__}: {exc}"
            connection.reset()
        if not detail and status // 100 != 4:
            detail = data[:300].decode(errors="replace")
        report.results.append(CaseResult(case, status, error, follow_ok, detail))
    connection.conn.close()
    return report


def _error_object(data: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(data)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None
