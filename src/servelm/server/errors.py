"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, always with a 4xx/5xx.

Every way a request can fail ends here, so clients (the openai package, lm-eval, curl)
always get a body that says what was wrong and which parameter, never FastAPI's 422 list.
A 5xx never carries an exception's text (it may hold paths, tracebacks, other requests'
data): the client gets a generic message with an id to find the logged detail by.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.openai_api.errors import INVALID_REQUEST, SERVER_ERROR, error_body, error_response, on_http_exception
from servelm.tenancy.limits import LimitExceeded

logger = logging.getLogger(__name__)
ENGINE_DOWN_MESSAGE = "The engine is not running; the server log says why."


class APIError(Exception):
    """Raise anywhere in a handler; becomes an OpenAI error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> Response:
        return error_response(
            self.status, self.message, type=self.type, param=self.param, code=self.code, headers=self.headers
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    # OpenAI's words, the same whether the model is served to no one or only not to this caller's
    # tenant (a tenants file's `models`): an answer must not tell a tenant what others may use.
    return APIError(
        404, f"The model `{model}` does not exist or you do not have access to it.", param="model",
        code="model_not_found",
    )


def overloaded(retry_after_s: int, waiting: int, limit: int) -> APIError:
    return APIError(
        429,
        f"The server is overloaded: {waiting} requests are waiting (limit {limit}). Retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def tenant_limit_error(exc: LimitExceeded) -> APIError:
    """A tenant at its limit: 429 with Retry-After (the shape of `overloaded`), or 400 for a
    request larger than the limit itself (it would never fit)."""
    if exc.retry_after_s is None:
        return APIError(400, exc.message, param="max_tokens", code="request_too_large")
    return APIError(429, exc.message, type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(exc.retry_after_s)})  # fmt: skip


def too_large_to_queue(size: int, limit: int) -> APIError:
    """A request that could never be admitted, however long it waited: a 400, never a 429 to retry."""
    return APIError(
        400,
        f"This request needs {size} engine requests (prompts x n) but the server queues at most {limit}: "
        "split it into smaller requests.",
        param="n",
        code="request_too_large",
    )


def unavailable(message: str, retry_after_s: int = 5) -> APIError:
    return APIError(
        503, message, type=SERVER_ERROR, code="service_unavailable", headers={"Retry-After": str(retry_after_s)}
    )


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic errors → one 400 naming the first bad parameter, in words a client can act on."""
    if not errors:
        return APIError(400, "Invalid request.")
    error = _most_telling(errors)
    location: list[str] = []
    for part in error.get("loc", ()):
        if part == "body":
            continue
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part.startswith("constrained-")):
            break  # a union member's tag (`prompt.list[int].3`): the field itself is what to name
        location.append(str(part))
    param = ".".join(location) or None
    kind = error.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"Invalid JSON in the request body: {error.get('msg')}")
    if kind in ("model_type", "model_attributes_type", "dict_type") and param is None:
        return APIError(400, "The request body must be a JSON object.")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param)
    return APIError(400, f"Invalid value for '{param}': {error.get('msg', 'invalid')}.", param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tagged-union", "union"}


def _most_telling(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The first error, unless it is one union member's type mismatch and a sibling error on the same
    field says more (`stop: ["x"*2000]` is too long, not "should be a valid string")."""
    first = errors[0]
    field = tuple(first.get("loc", ()))[:1]
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:1] == field]
    return next((e for e in same_field if not str(e.get("type", "")).endswith("_type")), first)


def from_invalid_json(body: bytes, error: Mapping[str, Any]) -> APIError:
    """A body our JSON parser refused. The one case Python's parser accepts is a lone UTF-16
    surrogate (`"\\ud800"`, not Unicode, so no text can hold it): name the field that has one."""
    try:
        path = _surrogate_path(json.loads(body))
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's parser goes
        return from_validation_errors([error])
    if path is None:
        return from_validation_errors([error])
    param = ".".join(path) or None
    return APIError(400, f"Invalid value for '{param}': the string holds a lone UTF-16 surrogate, which is not "
                         "valid Unicode.", param=param)  # fmt: skip


def _surrogate_path(value: Any, path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    if isinstance(value, str):
        return path if any("\ud800" <= c <= "\udfff" for c in value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _surrogate_path(key) is not None:
            return path
        found = _surrogate_path(item, (*path, str(key)))
        if found is not None:
            return found
    return None


async def _on_validation_error(_: Request, exc: RequestValidationError) -> Response:
    return from_validation_errors(list(exc.errors())).response()


async def _on_api_error(_: Request, exc: APIError) -> Response:
    return exc.response()


def internal_error(error_id: str) -> APIError:
    return APIError(
        500, f"Internal server error (error id {error_id}); the server log has the details.", type=SERVER_ERROR
    )


class InternalErrorMiddleware:
    """Any exception a handler lets escape: logged with an id, answered with a generic 500 that
    keeps the connection usable.

    It must sit inside Starlette's ServerErrorMiddleware, which re-raises after answering: uvicorn
    then closes the keep-alive connection without `Connection: close`, and the client's next pooled
    request fails with a reset. Here the exception ends. A stream that already started cannot get a
    status any more: uvicorn closes that connection, which is the one honest signal left.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            logger.exception("error %s in %s %s", error_id, scope.get("method"), scope.get("path"))
            if started:
                raise
            await internal_error(error_id).response()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_exception)  # type: ignore[arg-type]
    app.add_middleware(InternalErrorMiddleware)  # added first: the innermost middleware, inside ServerErrorMiddleware
