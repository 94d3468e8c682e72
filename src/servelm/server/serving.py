"""What /v1/completions and /v1/chat/completions share: admission, prompt checks, the
disconnect watch of a non-streaming request, SSE framing and the end-of-request record."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive

from servelm.datatypes import RequestSlo
from servelm.engine.async_client import EngineDeadError, lost_with_core
from servelm.engine.async_llm import GenerationStream, PromptError
from servelm.engine.supervisor import RESTARTING_RETRY_AFTER_S
from servelm.obs.timeline import ApiStamp, RequestTimeline
from servelm.openai_api.auth import CALLER_STATE
from servelm.openai_api.stall_guard import stream_watch
from servelm.sampling_params import SamplingParams
from servelm.server.context import ServerContext
from servelm.server.errors import (
    ENGINE_DOWN_MESSAGE,
    APIError,
    bad_request,
    error_body,
    model_not_found,
    tenant_limit_error,
    unavailable,
)
from servelm.server.tenant_limits import LEASE_STATE
from servelm.tenancy.limits import Lease, LimitExceeded
from servelm.tenancy.registry import request_slo

logger = logging.getLogger(__name__)
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
# The error code of a request whose engine core died under it (503, or its stream's error event).
ENGINE_CORE_DIED = "engine_core_died"
TTFT_HEADER = "x-servelm-ttft-breakdown"
_json = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def json_response(payload: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(payload), media_type="application/json", headers=headers)


def sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    # X-Accel-Buffering: a reverse proxy must not batch up tokens.
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def new_request(http_request: Request, prefix: str, streaming: bool) -> tuple[str, RequestTimeline]:
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    timeline = RequestTimeline(request_id, streaming)
    wall, mono = getattr(http_request.state, "servelm_received", (time.time(), time.perf_counter()))
    timeline.stamp(ApiStamp.RECEIVED, wall, mono)
    return request_id, timeline


class GenerationBody(Protocol):
    """What both endpoints' request bodies offer the shared prologue."""

    model: str | None
    stream: bool

    def check(self) -> None: ...

    def to_sampling_params(self) -> SamplingParams: ...


class GenerationView(Protocol):
    """An endpoint's rendering of one GenerationStream: as an SSE stream or as one JSON response."""

    def stream(self) -> AsyncIterator[bytes]: ...

    async def collect(self) -> Response: ...


def begin_request(
    ctx: ServerContext, http_request: Request, prefix: str, body: GenerationBody
) -> tuple[str, RequestTimeline, SamplingParams]:
    """The checks every generation request passes before its prompt is tokenized."""
    request_id, timeline = new_request(http_request, prefix, body.stream)
    check_model(ctx, body.model, http_request)
    body.check()
    params = body.to_sampling_params()
    check_token_ids(ctx, params.stop_token_ids, "stop_token_ids")
    return request_id, timeline, params


async def respond(http_request: Request, gen: GenerationStream, view: GenerationView, streaming: bool) -> Response:
    """Start the generation and answer with its stream (watched by the stall guard: what waits
    for the client, how to stop), or with the whole response; a client that leaves a
    non-streaming request early gets 499 (nginx's "client closed request")."""
    await start_generation(gen)
    if streaming:
        watch = stream_watch(http_request.state)
        if watch is not None:  # a cut aborts the request in the core at once: its KV blocks free
            watch.attach(backlog=lambda: gen.num_outputs_queued, on_cut=gen.close)
        return sse_response(view.stream())
    response = await until_disconnect(http_request, view.collect(), gen)
    return response if response is not None else Response(status_code=499)


def tenant_priority(http_request: Request, priority: int, kv_retention: str | None = None) -> tuple[int, RequestSlo]:
    """The priority the request runs at (the client's, clamped by its tenant) and its SLO stamp,
    with the request's own `kv_retention` hint over its class's."""
    priority, slo = request_slo(getattr(http_request.state, CALLER_STATE), priority)
    if kv_retention is not None:
        slo = msgspec.structs.replace(slo, kv_retention=kv_retention)
    return priority, slo


def reserve_tokens(http_request: Request, gen: GenerationStream, max_model_len: int) -> None:
    """Take the request's prompt + max_tokens (per choice; up to the context without max_tokens)
    from its tenant's tokens per minute: 429/400 when they do not fit. What it does not generate
    goes back when the request ends (TenantLimitsMiddleware releases the lease)."""
    lease: Lease = getattr(http_request.state, LEASE_STATE)
    max_tokens = gen.fan_out.params.max_tokens
    n = gen.fan_out.params.n
    max_new = sum((max_tokens if max_tokens is not None else max_model_len - len(p)) * n for p in gen.prompts)
    try:
        lease.reserve(sum(len(p) for p in gen.prompts), max_new)
    except LimitExceeded as exc:
        raise tenant_limit_error(exc) from exc
    lease.count_generated(lambda: gen.num_generated_tokens)


def check_model(ctx: ServerContext, model: str | None, http_request: Request | None = None) -> str | None:
    """404 model_not_found unless `model` is absent, the served model or one of its adapters, and
    (given the request) one its caller's tenant may use (the base model when absent). Returns the
    adapter it names (lora_name_of)."""
    adapter = lora_name_of(ctx, model)
    caller = getattr(http_request.state, CALLER_STATE, None) if http_request is not None else None
    name = model if model is not None else ctx.model_name
    if caller is not None and not caller.may_use(name):
        raise model_not_found(name)
    return adapter


def lora_name_of(ctx: ServerContext, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model); 404 for a name served by no one."""
    if model is None or model == ctx.model_name:
        return None
    if any(module.name == model for module in ctx.lora_modules):
        return model
    raise model_not_found(model)


def check_prompts(
    ctx: ServerContext, prompts: list[list[int]], params: SamplingParams, param: str, client_ids: bool = False,
    completion_param: str = "max_tokens",
) -> None:
    """Empty, too-long and (for ids the client sent) out-of-vocabulary prompts are the client's error;
    the error names `param` (the prompt's), or `completion_param` when the prompt fits and the
    completion asked for does not."""
    try:
        ctx.engine.check_prompts(prompts, params, check_ids=client_ids)
    except PromptError as exc:
        raise bad_request(str(exc), param=completion_param if exc.by_completion else param, code=exc.code) from exc


def check_token_ids(ctx: ServerContext, token_ids: list[int], param: str) -> None:
    """Ids the client sent must exist in the vocabulary."""
    try:
        ctx.engine.check_token_ids(token_ids)
    except PromptError as exc:
        raise bad_request(str(exc), param=param) from exc


async def render_chat(ctx: ServerContext, messages: list[dict[str, Any]], add_generation_prompt: bool,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:  # fmt: skip
    """Token ids of `messages` (and function `tools`) through the model's chat template; a
    conversation the template rejects (roles out of order, ...) is the client's error."""
    try:
        return await ctx.engine.render_chat(messages, add_generation_prompt, tools)
    except PromptError as exc:
        raise bad_request(str(exc), param="messages") from exc


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` says how much of the prompt
    the prefix cache served (what makes a repeated long prompt fast)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class Finished:
    """The end-of-request record: metrics, the JSON log line, and the timeline if asked for."""

    timeline_dict: dict[str, Any] | None
    ttft_header: dict[str, str]


def finish_request(ctx: ServerContext, gen: GenerationStream, prompt_tokens: int, completion_tokens: int, want_timeline: bool) -> Finished:
    timeline = gen.timeline
    timeline.stamp(ApiStamp.FINISHED)
    breakdown = timeline.breakdown()
    if breakdown is not None:
        ctx.metrics.observe_ttft(gen.slo, breakdown)
    ctx.request_logger.log(
        timeline,
        model=ctx.model_name,
        tenant=gen.slo.tenant,
        slo_class=gen.slo.slo_class,
        priority=gen.priority,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        finish_reasons=[c.state.finish_reason if c.state else None for c in gen.choices],
    )
    header = {TTFT_HEADER: breakdown.header_value()} if breakdown is not None and not timeline.streaming else {}
    return Finished(timeline.to_dict() if want_timeline else None, header)


def engine_error(gen: GenerationStream) -> str | None:
    return gen.error


def engine_failure_message(gen: GenerationStream) -> str:
    """What the client hears of an engine failure: no detail (it may be a traceback), the request id
    to find it by; the detail goes to the server log, once per request."""
    if lost_with_core(gen.error):  # the core died under it: logged once for all by the client and supervisor
        return (f"The engine core died while running request {gen.request_id}; it is restarted unless it "
                "crashed too often (GET /health says which): retry the request.")  # fmt: skip
    logger.error("request %s failed in the engine: %s", gen.request_id, gen.error)
    return f"The engine failed while running request {gen.request_id}; the server log has the details."


def stream_error_event(gen: GenerationStream) -> bytes:
    code = ENGINE_CORE_DIED if lost_with_core(gen.error) else None
    return sse(error_body(engine_failure_message(gen), "server_error", code=code))


async def until_disconnect(http_request: Request, work: Awaitable[T], gen: GenerationStream) -> T | None:
    """Run a non-streaming request's work; if the client goes away first, abort it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(http_request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server gave up on this request (shutdown deadline)
        task.cancel()
        gen.close()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    gen.close()
    return None


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def start_generation(gen: GenerationStream) -> None:
    """Start (a failed start leaves nothing in the core); a dead engine is a 503."""
    try:
        await gen.start()
    except EngineDeadError as exc:
        logger.error("request %s: the engine is not running: %s", gen.request_id, exc)
        raise unavailable(ENGINE_DOWN_MESSAGE, retry_after_s=RESTARTING_RETRY_AFTER_S) from exc


def api_error_from_engine(gen: GenerationStream) -> APIError:
    """A non-streaming request's engine failure: 503 (Retry-After) when the core died under it, a
    request the client may send again; else 500."""
    if lost_with_core(gen.error):
        return APIError(503, engine_failure_message(gen), type="server_error", code=ENGINE_CORE_DIED,
                        headers={"Retry-After": str(RESTARTING_RETRY_AFTER_S)})  # fmt: skip
    return APIError(500, engine_failure_message(gen), type="server_error")


def stream_tail(
    ctx: ServerContext, gen: GenerationStream, header: dict[str, Any], include_usage: bool, want_timeline: bool,
    prompt_tokens: int, completion_tokens: int,
) -> list[bytes]:  # fmt: skip
    """A stream's last events once its generation ended: the engine's error (if it failed), the
    usage/timeline chunk (if asked for), and `[DONE]`; the request's end is recorded here."""
    events = []
    if engine_error(gen) is not None:
        events.append(stream_error_event(gen))
    done = finish_request(ctx, gen, prompt_tokens, completion_tokens, want_timeline)
    final = _final_chunk(header, include_usage, usage(prompt_tokens, completion_tokens, gen.num_cached_prompt_tokens),
                         done.timeline_dict)  # fmt: skip
    if final is not None:
        events.append(sse(final))
    events.append(DONE)
    return events


def _final_chunk(
    header: dict[str, Any], include_usage: bool, usage_object: dict[str, Any], timeline: dict | None
) -> dict[str, Any] | None:
    """The chunk after all content: usage (if asked) and the timeline (if asked), with no choices."""
    if not include_usage and timeline is None:
        return None
    chunk: dict[str, Any] = {**header, "choices": []}
    if include_usage:
        chunk["usage"] = usage_object
    if timeline is not None:
        chunk["servelm"] = {"timeline": timeline}
    return chunk
