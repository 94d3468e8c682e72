"""`servelm router`: the OpenAI-compatible front over replicas, and its admin API.

    POST /v1/completions, /v1/chat/completions   routed (proxy.py), streamed through
    GET  /v1/models, /v1/models/{id}              from any healthy replica
    POST /tokenize, /detokenize                   from any healthy replica
    GET  /health, /ready                          200 while at least one replica is in rotation
    GET  /metrics                                 router metrics (servelm:router_*)
    /v1/files, /v1/batches                        the Batch API (servelm.batch.routes): lines routed as above
    GET  /admin/replicas                          every replica: health, load, index sizes
    POST /admin/replicas    {"url", "kv_events"?, "role"?}  add one at runtime (in rotation after its first
                                                   health check; "role" is checked against what it reports)
    DELETE /admin/replicas  {"url"}               remove one (its index dropped)

With an API key, everything but /health, /ready and /metrics requires `Authorization: Bearer KEY`
(as the server does); the client's Authorization header is forwarded to the replicas unchanged.
Admin bodies must be JSON (415 otherwise); generation bodies are checked by the replica, but
their size here (--max-request-body-mb: 413). Overload (router/limits.py): requests in flight in
all and per client (429), and a client that stops reading is cut after --stream-stall-timeout-s,
its upstream request with it (openai_api/stall_guard.py; until then the router reads from the
replica only as fast as the client reads, so nothing piles up here).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from servelm.batch.arguments import BatchOptions
from servelm.batch.executor import AppExecutor
from servelm.batch.pacing import BatchPacer, EngineLoad
from servelm.batch.routes import add_batch_routes
from servelm.batch.service import BatchService, open_batch_service
from servelm.openai_api.auth import ApiKeyMiddleware, single_key
from servelm.openai_api.body_limit import BodyLimitMiddleware
from servelm.openai_api.content_type import NOT_JSON_MESSAGE, is_json_content_type
from servelm.openai_api.errors import INVALID_REQUEST, SERVER_ERROR, error_response, on_http_exception
from servelm.openai_api.open_files import raise_open_files_limit
from servelm.openai_api.overload import GENERATION_PATHS, OverloadOptions
from servelm.openai_api.stall_guard import StallGuardMiddleware
from servelm.router.adapters import LOAD_PATH, UNLOAD_PATH, record_change
from servelm.router.health import HealthChecker
from servelm.router.kv_index import TIERS_NEAREST_FIRST
from servelm.router.limits import RouterLimitsMiddleware
from servelm.router.proxy import Proxy, request_headers
from servelm.router.replicas import ReplicaSpec
from servelm.router.state import Router, RouterOptions
from servelm.tenancy.limits import InFlightLimits
from servelm.tokenization.prompt_tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
BATCH_LINES_PER_REPLICA = 32  # batch lines in flight per replica in rotation, by default
# Policies that look at prompt tokens; the others need the tokenizer only to size prompts for disaggregation.
_TOKENIZING_POLICIES = {"prefix", "kv"}


@dataclass(frozen=True)
class RouterServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model: str | None = None  # whose tokenizer to hash prompts with (the replicas' model)
    replicas: Sequence[ReplicaSpec] = ()
    max_request_body_mb: float = 32.0  # larger generation bodies get 413, unread
    overload: OverloadOptions = OverloadOptions()
    batch: BatchOptions = BatchOptions()  # batch jobs: their lines routed like any request


def _load_tokenizer(model: str | None) -> PromptTokenizer:
    from servelm.tokenization.loading import (
        load_tokenizer,  # pulls in transformers: only when needed
    )

    return PromptTokenizer(load_tokenizer(model))


def create_router_app(router_options: RouterOptions, options: RouterServerOptions) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = Router(router_options)
        for spec in options.replicas:
            router.add_replica(spec)
        tokenizer = None
        if router_options.policy in _TOKENIZING_POLICIES or router_options.disagg:
            tokenizer = await asyncio.to_thread(_load_tokenizer, options.model)
        timeout = httpx.Timeout(connect=router_options.connect_timeout_s, read=None, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
        client = httpx.AsyncClient(timeout=timeout, limits=limits)
        # The replicas' role endpoint is under /v1: a cluster gives them the router's key.
        replica_headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        health = HealthChecker(router, client, replica_headers)
        await health.check_all()  # in rotation from the first request, when healthy already
        health.start()
        app.state.router = router
        app.state.health = health
        app.state.proxy = Proxy(router, client, tokenizer)
        app.state.batches = open_batch_service(options.batch, "router", options.port)
        if isinstance(app.state.batches, BatchService):
            await _start_batches(app, router, options, replica_headers)
        try:
            yield
        finally:
            if isinstance(app.state.batches, BatchService):
                await app.state.batches.stop()  # lines in flight stay undone: the next start runs them
            await health.stop()
            await app.state.proxy.close()
            await router.close()
            await client.aclose()
            if tokenizer is not None:
                tokenizer.shutdown()

    app = FastAPI(title="servelm router", lifespan=lifespan, docs_url=None, redoc_url=None)
    _add_routes(app)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)  # type: ignore[arg-type]
    # The last added runs first: the key, the limits (before the body is read), the body's size.
    overload = options.overload

    def record_cut() -> None:
        app.state.router.metrics.streams_cut.inc()

    app.add_middleware(StallGuardMiddleware, paths=GENERATION_PATHS, stall_timeout_s=overload.stream_stall_timeout_s,
                       record_cut=record_cut)  # fmt: skip
    app.add_middleware(BodyLimitMiddleware, paths=GENERATION_PATHS, max_bytes=int(options.max_request_body_mb * 2**20))
    limits = InFlightLimits(overload.max_concurrent_requests, overload.max_concurrent_requests_per_client)
    app.add_middleware(RouterLimitsMiddleware, limits=limits)
    app.add_middleware(ApiKeyMiddleware, authenticate=single_key(options.api_key), open_paths=_OPEN_PATHS)
    return app


async def _start_batches(app: FastAPI, router: Router, options: RouterServerOptions, replica_headers: dict[str, str]) -> None:
    """Batch lines go through this router's own routes, so its policy spreads them over the
    replicas; each replica's scheduler runs them in the batch class (their priority says so).
    The router sees no replica's queue: it paces to a ceiling of BATCH_LINES_PER_REPLICA per
    replica in rotation (or --batch-max-in-flight), and each replica protects its interactive
    requests itself (batch lines are scheduled last and preempted first)."""
    service: BatchService = app.state.batches

    def ceiling() -> int:
        fixed = options.batch.batch_max_in_flight
        return fixed or BATCH_LINES_PER_REPLICA * sum(r.healthy for r in router.replicas.all())

    def load() -> EngineLoad:
        return EngineLoad(num_waiting=0, num_in_flight=sum(r.in_flight for r in router.replicas.all()))

    headers = [(name.lower().encode(), value.encode()) for name, value in replica_headers.items()]
    await service.start(AppExecutor(app, headers), BatchPacer(load, ceiling), lambda tenant: True)


def _replica_summary(router: Router) -> list[dict[str, Any]]:
    kv, prefix = router.context.kv_index, router.context.prefix_index
    summary = []
    for r in router.replicas.all():
        summary.append({
            "url": r.url, "kv_events": r.spec.kv_events, "healthy": r.healthy, "in_flight": r.in_flight,
            "role": r.kv_role, "configured_role": r.spec.role, "transfer_address": r.transfer_address,
            "prefills_in_flight": r.prefills_in_flight,
            "outstanding_tokens": r.outstanding_tokens, "num_requests": r.num_requests, "last_error": r.last_error,
            "kv_synced": kv.is_synced(r.url), "kv_index_blocks": kv.replica_size(r.url),
            "kv_index_tier_blocks": {medium: kv.replica_size(r.url, medium) for medium in TIERS_NEAREST_FIRST},
            "prefix_index_blocks": prefix.size(r.url),
            "lora_adapters": sorted(r.adapters) if r.adapters is not None else None,
        })  # fmt: skip
    return summary


async def _json_body(request: Request) -> dict[str, Any] | Response:
    """The admin body as a dict ({} when it is not an object), or the 415 for a non-JSON one."""
    if await request.body() and not is_json_content_type(request.headers.get("content-type")):
        return error_response(415, NOT_JSON_MESSAGE, type=INVALID_REQUEST, code="unsupported_media_type")
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {}


def _add_routes(app: FastAPI) -> None:
    add_batch_routes(app)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def generate(request: Request) -> Response:
        return await request.app.state.proxy.forward(request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await request.app.state.proxy.get_any("/v1/models", request_headers(request))

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await request.app.state.proxy.get_any(request.url.path, request_headers(request))

    @app.post(LOAD_PATH)
    @app.post(UNLOAD_PATH)
    async def lora_adapter(request: Request) -> Response:
        response, done = await request.app.state.proxy.post_all(request)
        body = await _json_body(request)
        if not isinstance(body, Response):
            record_change(done, request.url.path, body.get("lora_name"))
        return response

    @app.post("/tokenize")
    @app.post("/detokenize")
    async def tokenize(request: Request) -> Response:
        return await request.app.state.proxy.post_any(request)

    @app.get("/health")
    @app.get("/ready")  # the same: a router is ready when it can route (clusters, probes poll /ready)
    async def health(request: Request) -> Response:
        healthy = request.app.state.router.replicas.healthy()
        if not healthy:
            return error_response(503, "no replica in rotation", type=SERVER_ERROR, code="no_replica_available")
        return Response(json.dumps({"status": "ok", "replicas": len(healthy)}), media_type="application/json")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/replicas")
    async def list_replicas(request: Request) -> Response:
        return Response(
            json.dumps({"replicas": _replica_summary(request.app.state.router)}), media_type="application/json"
        )

    @app.post("/admin/replicas")
    async def add_replica(request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        try:
            spec = ReplicaSpec.parse(str(body.get("url", "")))
        except ValueError as exc:
            return error_response(400, str(exc), type=INVALID_REQUEST, param="url")
        try:
            role = body.get("role")
            spec = ReplicaSpec(spec.url, str(body["kv_events"]) if body.get("kv_events") else None,
                               str(role) if role is not None else None)  # fmt: skip
        except ValueError as exc:
            return error_response(400, str(exc), type=INVALID_REQUEST, param="role")
        router: Router = request.app.state.router
        replica = router.add_replica(spec)
        await request.app.state.health.check_all()
        return Response(
            json.dumps({"url": replica.url, "healthy": replica.healthy}), 201, media_type="application/json"
        )

    @app.delete("/admin/replicas")
    async def remove_replica(request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        url = body.get("url") or request.query_params.get("url", "")
        removed = await request.app.state.router.remove_replica(str(url))
        status = 200 if removed else 404
        return Response(json.dumps({"url": url, "removed": removed}), status, media_type="application/json")


def run_router(router_options: RouterOptions, options: RouterServerOptions) -> int:
    """Serve until SIGINT/SIGTERM. In-flight streams are given a few seconds to finish."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request and health poll otherwise
    app = create_router_app(router_options, options)
    raise_open_files_limit()
    config = uvicorn.Config(
        app, host=options.host, port=options.port, loop="asyncio", http="h11", lifespan="on",
        access_log=False, timeout_graceful_shutdown=10, log_level="info",
    )  # fmt: skip
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1
