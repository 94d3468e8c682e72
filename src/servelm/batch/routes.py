"""The OpenAI Files and Batch APIs over HTTP, on either front (the server, the router):

    POST   /v1/files                  multipart: purpose=batch, file=@input.jsonl (413 over --max-batch-file-mb)
    GET    /v1/files                  ?purpose= &limit= &after= &order=
    GET    /v1/files/{id}             DELETE /v1/files/{id}        GET /v1/files/{id}/content
    POST   /v1/batches                {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches                ?limit= &after=
    GET    /v1/batches/{id}           POST /v1/batches/{id}/cancel

Every route is keyed like the rest of /v1; the key's tenant owns what it creates (the router's
single key: tenant "default"). Errors are OpenAI's shape; a front without a BatchService (its data
directory held by another process) answers 503 saying why.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import FileResponse, Response

from servelm.batch.service import BatchRequestError, BatchService
from servelm.openai_api.auth import CALLER_STATE
from servelm.openai_api.body_limit import body_too_large_message, read_within
from servelm.openai_api.content_type import NOT_JSON_MESSAGE, is_json_content_type
from servelm.openai_api.errors import INVALID_REQUEST, SERVER_ERROR, error_response
from servelm.tenancy.config import DEFAULT_TENANT

P = ParamSpec("P")
MAX_LIST_LIMIT = 10_000
MAX_CREATE_BODY_BYTES = 1 << 20


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def tenant_of(request: Request) -> str:
    """The caller's tenant (the server's key names one; the router's single key is "default")."""
    return getattr(getattr(request.state, CALLER_STATE, None), "name", DEFAULT_TENANT)


def _json(payload: dict[str, Any]) -> Response:
    return Response(json.dumps(payload), media_type="application/json")


def _answers_errors(handler: Callable[P, Awaitable[Response]]) -> Callable[P, Awaitable[Response]]:
    """A BatchRequestError raised in `handler` becomes its OpenAI-shaped error response."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Response:
        try:
            return await handler(*args, **kwargs)
        except BatchRequestError as exc:
            kind = SERVER_ERROR if exc.status >= 500 else INVALID_REQUEST
            headers = {"Retry-After": "60"} if exc.status == 503 else None
            return error_response(exc.status, exc.message, type=kind, param=exc.param, code=exc.code, headers=headers)

    return wrapper


def _list(objects: list[dict[str, Any]], has_more: bool) -> Response:
    return _json({"object": "list", "data": objects, "has_more": has_more,
                  "first_id": objects[0]["id"] if objects else None,
                  "last_id": objects[-1]["id"] if objects else None})  # fmt: skip


def _limit(request: Request, default: int) -> int:
    raw = request.query_params.get("limit")
    try:
        limit = int(raw) if raw is not None else default
    except ValueError:
        limit = -1
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise BatchRequestError(400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {raw!r}", param="limit")
    return limit


async def _create_body(request: Request) -> CreateBatchRequest:
    if not is_json_content_type(request.headers.get("content-type")):
        raise BatchRequestError(415, NOT_JSON_MESSAGE, code="unsupported_media_type")
    body = await read_within(request, MAX_CREATE_BODY_BYTES)
    if body is None:
        raise BatchRequestError(413, body_too_large_message(MAX_CREATE_BODY_BYTES), code="request_too_large")
    try:
        return CreateBatchRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or None
        raise BatchRequestError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param) from exc


def _service(request: Request) -> BatchService:
    service = getattr(request.app.state, "batches", None)
    if not isinstance(service, BatchService):
        raise BatchRequestError(503, service or "batch jobs are not available yet", code="service_unavailable")
    return service


def add_batch_routes(app: FastAPI) -> None:
    """The routes, over `app.state.batches`: a BatchService, or why there is none (a string)."""

    @app.post("/v1/files")
    @_answers_errors
    async def upload_file(request: Request) -> Response:
        service = _service(request)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > service.limits.max_file_bytes + 64 * 1024:  # the form's own bytes
            raise BatchRequestError(413, f"the upload is over the limit of {service.limits.max_file_bytes} bytes "
                                         "(--max-batch-file-mb)", param="file", code="file_too_large")  # fmt: skip
        record = await service.upload(tenant_of(request), request.headers.get("content-type"), request.stream())
        return _json(record.openai_object())

    @app.get("/v1/files")
    @_answers_errors
    async def list_files(request: Request) -> Response:
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BatchRequestError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        records, has_more = await _service(request).list_files(tenant_of(request), request.query_params.get("purpose"),
                                                               _limit(request, MAX_LIST_LIMIT),
                                                               request.query_params.get("after"), order)  # fmt: skip
        return _list([r.openai_object() for r in records], has_more)

    @app.get("/v1/files/{file_id}")
    @_answers_errors
    async def get_file(request: Request, file_id: str) -> Response:
        return _json((await _service(request).get_file(tenant_of(request), file_id)).openai_object())

    @app.delete("/v1/files/{file_id}")
    @_answers_errors
    async def delete_file(request: Request, file_id: str) -> Response:
        await _service(request).delete_file(tenant_of(request), file_id)
        return _json({"id": file_id, "object": "file", "deleted": True})

    @app.get("/v1/files/{file_id}/content")
    @_answers_errors
    async def file_content(request: Request, file_id: str) -> Response:
        service = _service(request)
        record = await service.get_file(tenant_of(request), file_id)
        return FileResponse(service.file_path(record), media_type="application/octet-stream", filename=record.filename)

    @app.post("/v1/batches")
    @_answers_errors
    async def create_batch(request: Request) -> Response:
        service = _service(request)
        body = await _create_body(request)
        batch = await service.create_batch(tenant_of(request), body.input_file_id, body.endpoint,
                                           body.completion_window, body.metadata)  # fmt: skip
        return _json(batch.openai_object())

    @app.get("/v1/batches")
    @_answers_errors
    async def list_batches(request: Request) -> Response:
        records, has_more = await _service(request).list_batches(tenant_of(request), _limit(request, 20),
                                                                 request.query_params.get("after"))  # fmt: skip
        return _list([r.openai_object() for r in records], has_more)

    @app.get("/v1/batches/{batch_id}")
    @_answers_errors
    async def get_batch(request: Request, batch_id: str) -> Response:
        return _json((await _service(request).get_batch(tenant_of(request), batch_id)).openai_object())

    @app.post("/v1/batches/{batch_id}/cancel")
    @_answers_errors
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        return _json((await _service(request).cancel_batch(tenant_of(request), batch_id)).openai_object())
