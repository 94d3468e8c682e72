"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and a response carrying it.

The one builder of that shape: the API server's APIError (servelm.server.errors), its SSE error
event, the API-key check and the router's own errors all go through it, so clients (the openai
package, lm-eval, curl) parse one shape whichever process answered.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    type: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """A JSON response with `error_body`; `type` is OpenAI's error type (INVALID_REQUEST, SERVER_ERROR, ...)."""
    return Response(
        msgspec.json.encode(error_body(message, type, param, code)),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


async def on_http_exception(_: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404 for an unknown route, 405 for a wrong method) in OpenAI's shape:
    the exception handler of both the API server and the router."""
    kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
    return error_response(
        exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers) if exc.headers else None
    )
