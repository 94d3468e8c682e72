"""Request bodies larger than a front accepts: 413 in OpenAI's shape, before they are held whole.

A front that reads and parses a body itself (the server's JSON routes, the Batch API's create) reads
it with `read_within`, and answers the same message when it gives None; the router, which forwards
generation bodies, gets this middleware: it reads a generation request's body up to
`max_bytes` (a declared Content-Length above it is refused without reading a byte), then hands
the app the body it read.
"""

from __future__ import annotations

from collections.abc import Collection

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.openai_api.errors import INVALID_REQUEST, error_response


def body_too_large_message(max_bytes: int) -> str:
    return f"The request body is larger than this server accepts ({max_bytes} bytes)."


async def read_within(request: Request, max_bytes: int) -> bytes | None:
    """The body, or None as soon as it exceeds `max_bytes`: a declared Content-Length above it
    without reading a byte, a streamed body at the chunk that crosses it (nothing more is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, paths: Collection[str], max_bytes: int) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        body = None if declared.isdigit() and int(declared) > self.max_bytes else await self._read(receive)
        if body is None:
            response = error_response(413, body_too_large_message(self.max_bytes), type=INVALID_REQUEST,
                                      code="request_too_large")  # fmt: skip
            await response(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it exceeds the limit (or the client left)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
