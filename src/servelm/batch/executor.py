"""One batch line through the server's own ASGI app, in process: the same middleware (the
tenant's limits), validation, admission and engine path as a request over HTTP, without a socket.

The caller (the batch's tenant, in the batch class) is put in the scope's state before the app
sees it; the API-key check lets such a request through (an HTTP client cannot write the state).
The line's "client" never disconnects: the request runs to its end unless the batch stops it,
which cancels the call (and with it the engine request: its KV blocks free).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from servelm.openai_api.auth import CALLER_STATE

BATCH_CLIENT = ("batch", 0)  # the scope's client: what the per-client limits see


@dataclass(frozen=True)
class LineResponse:
    status_code: int
    body: dict[str, Any]
    retry_after_s: float | None  # the Retry-After of a 429 or 503, when it says one


class AppExecutor:
    def __init__(self, app: ASGIApp, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """`headers`: sent with every line (the router's: the key its replicas take)."""
        self.app = app
        self.headers = list(headers)

    async def post(self, path: str, body: bytes, caller: object) -> LineResponse:
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "client": BATCH_CLIENT, "server": ("127.0.0.1", 0),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *self.headers],
            "state": {CALLER_STATE: caller},
        }  # fmt: skip
        sent = False
        never = asyncio.Event()
        status = 500
        headers: dict[bytes, bytes] = {}
        chunks: list[bytes] = []

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()  # the client stays: only the batch stopping the line ends the call
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers.update((k.lower(), v) for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        return LineResponse(status, _json_body(b"".join(chunks), status), _retry_after(headers))


def _json_body(raw: bytes, status: int) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        return value
    return {"error": {"message": raw.decode("utf-8", "replace")[:1000] or f"HTTP {status}", "type": "server_error"}}


def _retry_after(headers: dict[bytes, bytes]) -> float | None:
    try:
        return float(headers[b"retry-after"])
    except (KeyError, ValueError):
        return None
