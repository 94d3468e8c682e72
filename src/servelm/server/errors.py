"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, always with a 4xx/5xx.

Every way a request can fail ends here, so clients (the openai package, lm-eval, curl)
always get a body that says what was wrong and which parameter, never FastAPI's 422 list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from servelm.openai_api.errors import INVALID_REQUEST, SERVER_ERROR, error_body, error_response


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
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def overloaded(retry_after_s: int, waiting: int, limit: int) -> APIError:
    return APIError(
        429,
        f"The server is overloaded: {waiting} requests are waiting (limit {limit}). Retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str, retry_after_s: int = 5) -> APIError:
    return APIError(
        503, message, type=SERVER_ERROR, code="service_unavailable", headers={"Retry-After": str(retry_after_s)}
    )


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic errors → one 400 naming the first bad parameter, in words a client can act on."""
    if not errors:
        return APIError(400, "Invalid request.")
    error = errors[0]
    location: list[str] = []
    for part in error.get("loc", ()):
        if part == "body":
            continue
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):
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


async def _on_validation_error(_: Request, exc: RequestValidationError) -> Response:
    return from_validation_errors(list(exc.errors())).response()


async def _on_api_error(_: Request, exc: APIError) -> Response:
    return exc.response()


async def _on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
    kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
    headers = dict(exc.headers) if exc.headers else None
    return APIError(exc.status_code, str(exc.detail), type=kind, headers=headers).response()


async def _on_unexpected(_: Request, exc: Exception) -> Response:
    return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}", type=SERVER_ERROR).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)
