"""The OpenAI-compatible HTTP server: app factory, routes, and `servelm serve`'s entry point.

    uvicorn ─▶ _ArrivalStamp ─▶ ApiKeyMiddleware ─▶ TenantLimitsMiddleware ─▶ StallGuardMiddleware ─▶ InternalErrorMiddleware
                                (the tenant)      (in flight, tokens/min)    (slow clients cut)      ─▶ FastAPI routes
                                                                  ─▶ completions / chat ─▶ AsyncEngineClient ─ZMQ─▶ engine core

The server listens at once and the engine starts behind it (server/lifecycle.py): /live says the
process is alive, /health and /ready that it serves; until then every engine route answers 503.

With an API key (--api-key, or the keys of a --tenants file: servelm.tenancy.registry), every
route needs one but /live, /health and /ready (probes, load balancers) and, unless --protect-metrics, /metrics
(Prometheus; vLLM leaves both open too). /tokenize and /detokenize do work, so they are keyed;
so is /openapi.json. A key names its tenant: its SLO class, priority range and limits. A POST body must be JSON
(`Content-Type: application/json`, else 415: a browser page cannot send one cross-origin
without a CORS preflight) and at most --max-request-body-mb (else 413).

Overload (openai_api/overload.py): --max-concurrent-requests and its per-client twin refuse a
generation request with 429 before its body is read; --max-waiting-requests (admission.py) once it
is parsed, by what waits for the engine; a prompt that cannot fit the context is a 400 before it
is tokenized (prompt_limits.py); a client that stops reading its stream is cut after
--stream-stall-timeout-s, or as soon as --max-stream-backlog outputs wait for it, and its request
aborted (openai_api/stall_guard.py).

Shutdown (SIGTERM or SIGINT): new requests get 503 at once and uvicorn stops accepting
connections; in-flight requests run to completion for up to `--shutdown-timeout` seconds
(then they are cancelled, which aborts them in the core); then the core is stopped and the
process exits with code 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from servelm import envs
from servelm.batch.arguments import BatchOptions
from servelm.batch.executor import AppExecutor
from servelm.batch.metrics import BatchCollector
from servelm.batch.pacing import BatchPacer, EngineLoad
from servelm.batch.routes import add_batch_routes
from servelm.batch.service import BatchService, open_batch_service
from servelm.config import EngineConfig, LoRAModule
from servelm.delivery.source import PEER_MODEL_PREFIX, PEER_SCHEME
from servelm.delivery.streaming import remote_model_name
from servelm.engine.async_llm import AsyncLLM
from servelm.engine.supervisor import EngineSupervisor, RestartPolicy
from servelm.obs.loop_lag import EventLoopLagMonitor
from servelm.obs.metrics import ServerMetrics, starting_metrics
from servelm.obs.request_log import RequestLogger
from servelm.obs.startup import StartupTimeline
from servelm.openai_api.auth import CALLER_STATE, ApiKeyMiddleware
from servelm.openai_api.body_limit import body_too_large_message, read_within
from servelm.openai_api.content_type import NOT_JSON_MESSAGE, is_json_content_type
from servelm.openai_api.open_files import raise_open_files_limit
from servelm.openai_api.overload import DEFAULT_STALL_TIMEOUT_S, GENERATION_PATHS, OverloadOptions
from servelm.openai_api.stall_guard import StallGuardMiddleware
from servelm.server.admission import Admission
from servelm.server.chat import create_chat_completion
from servelm.server.completions import create_completion
from servelm.server.context import ServerContext
from servelm.server.errors import (
    APIError,
    from_invalid_json,
    from_validation_errors,
    install_error_handlers,
    unavailable,
)
from servelm.server.kv_transfer_api import KVTransferInfo
from servelm.server.lifecycle import ServerLifecycle
from servelm.server.lora_api import check_runtime_lora_allowed, load_lora_adapter, unload_lora_adapter
from servelm.server.model_files_api import ModelFiles, peer_served_name
from servelm.server.prompt_limits import PromptLimits
from servelm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from servelm.server.serving import check_model, json_response
from servelm.server.structured_request import StructuredCheck
from servelm.server.tenant_limits import TenantLimitsMiddleware
from servelm.server.tokenize_api import detokenize, tokenize
from servelm.tenancy.config import BUILTIN_CLASSES, TenantsConfigError, load_tenants
from servelm.tenancy.limits import InFlightLimits, TenantLimits
from servelm.tenancy.registry import TenantRegistry

logger = logging.getLogger(__name__)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting_requests: int = 1024
    max_request_body_mb: float = 32.0
    max_concurrent_requests: int | None = None  # openai_api/overload.py
    max_concurrent_requests_per_client: int | None = None
    stream_stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S  # None (0 on the command line): never
    max_stream_backlog: int | None = 4096  # engine outputs waiting for one stream's client; None: no bound
    protect_metrics: bool = False
    log_requests: bool = False
    shutdown_timeout_s: int = 30
    tokenizer_threads: int = 2
    tool_call_parser: str = "hermes"  # tool_choice "auto": how calls are read from the text ("none": never)
    tenants: Path | None = None  # the tenants file (servelm.tenancy.config)
    ssl_keyfile: str | None = None  # HTTPS: uvicorn's, as vLLM passes them
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # CA bundle to verify client certificates against
    max_engine_restarts: int = 3  # a dead engine core is restarted at most this often within the window
    engine_restart_window_s: float = 300.0
    batch: BatchOptions = BatchOptions()  # batch jobs (servelm.batch); in flight at most: --max-num-seqs by default

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        """CLI flags; the API key may also come from $SERVELM_API_KEY (the one place env is read)."""
        names = [name for name in cls.__dataclass_fields__ if getattr(args, name, None) is not None]
        values = {name: getattr(args, name) for name in names}
        if values.get("api_key") is None:
            values["api_key"] = envs.api_key()
        values["batch"] = BatchOptions.from_args(args)
        for name in ("stream_stall_timeout_s", "max_stream_backlog"):
            if values.get(name) == 0:
                values[name] = None  # 0 on the command line: off
        return cls(**values)

    def __post_init__(self) -> None:
        _ = self.overload  # its own checks, before anything starts
        if self.max_stream_backlog is not None and self.max_stream_backlog < 1:
            raise ValueError(f"--max-stream-backlog must be at least 1 (0: no bound), got {self.max_stream_backlog}")

    @property
    def overload(self) -> OverloadOptions:
        return OverloadOptions(self.max_concurrent_requests, self.max_concurrent_requests_per_client,
                               self.stream_stall_timeout_s)  # fmt: skip


def model_name_for(engine_config: EngineConfig, options: ServerOptions) -> str:
    if options.served_model_name:
        return options.served_model_name
    if engine_config.model.model is None:
        return DEFAULT_MODEL_NAME
    remote_name = remote_model_name(engine_config.model.model)
    if remote_name is not None:
        return remote_name
    path = Path(engine_config.model.model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


class _ArrivalStamp:
    """First thing a request meets: stamp its arrival, before the body is read (the timeline's "received")."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["servelm_received"] = (time.time(), time.perf_counter())
        await self.app(scope, receive, send)


async def _start_context(
    engine_config: EngineConfig, options: ServerOptions, on_phase: Callable[[str], None]
) -> ServerContext:
    engine = await AsyncLLM.start(engine_config, tokenizer_threads=options.tokenizer_threads, on_phase=on_phase)
    client, ready = engine.client, engine.client.ready
    assert ready is not None
    name = model_name_for(engine_config, options)
    if not options.served_model_name and (engine_config.model.model or "").startswith(PEER_SCHEME):
        name = await peer_served_name(engine_config.model.model or "", envs.peer_api_key(), default=name)
    metrics = ServerMetrics(name, ready.max_model_len, lambda: client.stats, ready.num_blocks,
                            num_in_api=lambda: client.num_in_flight, num_outputs_queued=lambda: engine.num_outputs_queued,
                            startup_seconds=StartupTimeline(list(ready.startup)).seconds_by_phase())  # fmt: skip
    client.on_stats = metrics.observe_steps
    policy = RestartPolicy(options.max_engine_restarts, options.engine_restart_window_s)
    supervisor = EngineSupervisor(client, policy, on_restart=metrics.observe_engine_restart)
    admission = Admission(
        max_waiting=options.max_waiting_requests,
        max_num_seqs=engine_config.scheduler.max_num_seqs,
        num_tokenizing=lambda: engine.tokenizer.num_pending,
        num_engine_in_flight=lambda: client.num_in_flight,
        num_core_queued=lambda: client.stats.num_queued,
        engine_down=supervisor.down,
    )
    # Its backend is built by the first structured request (~1-2 s, once): built at start-up it
    # would cost every replica ~100 MB and a core-second whether or not it ever sees one.
    structured = StructuredCheck(engine_config.structured.structured_outputs_backend, engine.tokenizer.tokenizer)
    logger.info(
        "serving %s (%s): context %d tokens, %d KV blocks", name, ready.source, ready.max_model_len, ready.num_blocks
    )
    return ServerContext(
        engine=engine,
        metrics=metrics,
        admission=admission,
        request_logger=RequestLogger(options.log_requests),
        model_name=name,
        kv_transfer=KVTransferInfo(engine_config.kv_transfer.kv_role, ready.kv_transfer_address, ready.block_size),
        model_files=ModelFiles.of_source(ready.source),
        prompt_limits=PromptLimits.for_tokenizer(engine.tokenizer.tokenizer, ready.max_model_len),
        supervisor=supervisor,
        structured=structured,
        tool_call_parser=None if options.tool_call_parser == "none" else options.tool_call_parser,
    )


def create_app(engine_config: EngineConfig, options: ServerOptions) -> FastAPI:
    """The ASGI app; its lifespan starts the engine core process in the background (the server
    listens meanwhile: `app.state.lifecycle` says how far it got), with the event-loop lag monitor
    once it is ready, and stops them at shutdown. TenantsConfigError for a bad --tenants file."""
    tenants = load_tenants(options.tenants) if options.tenants else None
    registry = TenantRegistry.build(tenants, options.api_key)
    batch_class = (tenants.classes if tenants is not None else BUILTIN_CLASSES)["batch"]
    lifecycle = ServerLifecycle()
    loop_lag: list[EventLoopLagMonitor] = []  # started once the engine is ready

    async def start(on_phase: Callable[[str], None]) -> ServerContext:
        ctx = await _start_context(engine_config, options, on_phase)
        gc.collect()
        gc.freeze()  # start-up objects (tokenizer, modules) never need scanning again: shorter GC pauses
        loop_lag.append(EventLoopLagMonitor(ctx.metrics.observe_loop_lag))
        loop_lag[0].start()
        ctx.supervisor.start()
        if isinstance(app.state.batches, BatchService):  # batch lines run from now on, the unfinished first
            client = ctx.engine.client
            ceiling = options.batch.batch_max_in_flight or engine_config.scheduler.max_num_seqs
            pacer = BatchPacer(lambda: EngineLoad(client.stats.num_waiting, client.num_in_flight), lambda: ceiling)
            await app.state.batches.start(AppExecutor(app), pacer, lambda name: registry.in_class(name, batch_class))
            ctx.metrics.registry.register(BatchCollector(ctx.model_name, app.state.batches))
        return ctx

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.batches = open_batch_service(options.batch, "server", options.port)
        starting = asyncio.create_task(lifecycle.start(start), name="engine-start")
        try:
            yield
        finally:
            lifecycle.drain()
            if isinstance(app.state.batches, BatchService):
                await app.state.batches.stop()  # lines in flight stay undone: the next start runs them
            if not starting.done():
                starting.cancel()  # AsyncLLM.start stops the core it spawned
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            for monitor in loop_lag:
                monitor.stop()
            if lifecycle.ctx is not None:
                await lifecycle.ctx.supervisor.wait_closed()  # drain() closed it: no restart races the shutdown
                await lifecycle.ctx.engine.shutdown()

    app = FastAPI(title="servelm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.lifecycle = lifecycle
    app.state.model_name = model_name_for(engine_config, options)
    app.state.max_body_bytes = int(options.max_request_body_mb * 2**20)
    install_error_handlers(app)
    _add_routes(app)
    # The last added runs first: the arrival is stamped before the key is checked, the key (the
    # tenant) before the limits, and a request holds its slot until the stall guard let it go.
    overload = options.overload

    def record_cut() -> None:
        if lifecycle.ctx is not None:
            lifecycle.ctx.metrics.streams_cut.inc()

    app.add_middleware(StallGuardMiddleware, paths=GENERATION_PATHS, stall_timeout_s=overload.stream_stall_timeout_s,
                       max_backlog=options.max_stream_backlog, record_cut=record_cut)  # fmt: skip
    in_flight = InFlightLimits(overload.max_concurrent_requests, overload.max_concurrent_requests_per_client)
    app.add_middleware(TenantLimitsMiddleware, limits=TenantLimits(registry.tenants, in_flight=in_flight))
    app.add_middleware(ApiKeyMiddleware, authenticate=registry.authenticate, open_paths=open_paths(options))
    app.add_middleware(_ArrivalStamp)
    return app


def open_paths(options: ServerOptions) -> frozenset[str]:
    """The routes that answer without an API key (when keys are set)."""
    probes = {"/live", "/health", "/ready"}
    return frozenset(probes if options.protect_metrics else probes | {"/metrics"})


def _lifecycle(request: Request) -> ServerLifecycle:
    return request.app.state.lifecycle


def _readiness_response(request: Request, status: str) -> Response:
    """/health's and /ready's answer: 503 with why the engine does not serve, else 200 `status`."""
    problem = _lifecycle(request).readiness_problem()
    if problem is not None:
        return unavailable(problem).response()
    return json_response({"status": status})


def _ctx(request: Request) -> ServerContext:
    """The serving context; 503 (Retry-After) while the engine is starting, or failed to."""
    return _lifecycle(request).serving_context()


async def _parse(request: Request, model: type[M]) -> M:
    """The body as `model`: 415 unless JSON, 413 when too large, 400 naming the bad field."""
    if not is_json_content_type(request.headers.get("content-type")):
        raise APIError(415, NOT_JSON_MESSAGE, code="unsupported_media_type")
    limit = request.app.state.max_body_bytes
    body = await read_within(request, limit)
    if body is None:
        raise body_too_large(limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            raise from_invalid_json(body, errors[0]) from exc
        raise from_validation_errors(errors) from exc


def body_too_large(limit: int) -> APIError:
    return APIError(413, body_too_large_message(limit), code="request_too_large")


def _add_routes(app: FastAPI) -> None:
    started_at = int(time.time())  # the model card's `created`
    add_batch_routes(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(_ctx(request), request, await _parse(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(_ctx(request), request, await _parse(request, ChatCompletionRequest))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(_ctx(request), await _parse(request, TokenizeRequest), request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(_ctx(request), await _parse(request, DetokenizeRequest), request)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_route(request: Request) -> Response:
        check_runtime_lora_allowed(_ctx(request))
        return await load_lora_adapter(_ctx(request), await _parse(request, LoadLoRAAdapterRequest))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_route(request: Request) -> Response:
        check_runtime_lora_allowed(_ctx(request))
        return await unload_lora_adapter(_ctx(request), await _parse(request, UnloadLoRAAdapterRequest))

    def model_card(ctx: ServerContext, adapter: LoRAModule | None = None) -> dict[str, Any]:
        """The base model's card, or an adapter's: vLLM's shape, its `parent` the base model."""
        if adapter is None:
            return {"id": ctx.model_name, "object": "model", "created": started_at, "owned_by": "servelm",
                    "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_model_len}  # fmt: skip
        return {"id": adapter.name, "object": "model", "created": started_at, "owned_by": "servelm",
                "root": adapter.path, "parent": adapter.base_model_name or ctx.model_name,
                "max_model_len": ctx.max_model_len}  # fmt: skip

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        ctx = _ctx(request)
        cards = [model_card(ctx), *(model_card(ctx, adapter) for adapter in ctx.lora_modules)]
        caller = getattr(request.state, CALLER_STATE, None)  # a tenant sees only the models it may use
        return json_response({"object": "list", "data": [c for c in cards if caller is None or caller.may_use(c["id"])]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        ctx = _ctx(request)
        adapter = check_model(ctx, model_id, request)
        return json_response(model_card(ctx, next((m for m in ctx.lora_modules if m.name == adapter), None)))

    @app.get("/v1/kv_transfer")
    async def kv_transfer(request: Request) -> Response:
        info = _ctx(request).kv_transfer
        if info.kv_role is None:
            return APIError(404, "this server has no --kv-role (no prefill/decode disaggregation)").response()
        return json_response(info.describe())

    @app.get(PEER_MODEL_PREFIX + "{path:path}")
    async def model_file(request: Request, path: str) -> Response:
        return await _ctx(request).model_files.response(path)

    @app.get("/live")
    async def live(request: Request) -> Response:
        """Liveness: 200 while the process is, or may come to be, serving (starting, restarting its
        engine, draining); 503 once only a new process can serve (start-up failed, restarts gave up)."""
        lifecycle = _lifecycle(request)
        problem = lifecycle.liveness_problem()
        if problem is not None:
            return unavailable(problem).response()
        return json_response({"status": lifecycle.live_status()})

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 only while the engine serves: a script that waits for it sends nothing too early."""
        return _readiness_response(request, "ok")

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Readiness, as /health (the name Kubernetes readiness probes and the router use)."""
        return _readiness_response(request, "ready")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx = _lifecycle(request).ctx
        body = ctx.metrics.render() if ctx is not None else starting_metrics(request.app.state.model_name)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


class _Server(uvicorn.Server):
    """uvicorn, plus: a signal flips the server to draining first; and no re-raise of the signal afterwards."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal once serving ends, so the process would die of
        # SIGTERM (exit -15) after draining; a drained shutdown is a clean exit, so we do not.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def run_server(engine_config: EngineConfig, args: argparse.Namespace) -> int:
    """`servelm serve`: serve until SIGTERM/SIGINT; 0 after a clean drain (also one during start-up),
    1 if start-up failed (the engine, the tokenizer: logged, then the server stops)."""
    try:
        options = ServerOptions.from_args(args)
        app = create_app(engine_config, options)
    except (TenantsConfigError, ValueError) as exc:  # a bad tenants file or flag: one line, no traceback
        logger.error("%s", exc)
        return 2
    raise_open_files_limit()
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        # uvloop and httptools when installed (about half the per-token cost of the pure-Python
        # h11 + asyncio pair), else asyncio and h11: same behaviour, both covered by the tests.
        loop="auto",
        http="auto",
        lifespan="on",
        access_log=False,
        log_level=logging.getLevelName(logging.getLogger().level).lower() if logging.getLogger().level else "info",
        timeout_graceful_shutdown=options.shutdown_timeout_s,
        ssl_keyfile=options.ssl_keyfile,
        ssl_certfile=options.ssl_certfile,
        ssl_ca_certs=options.ssl_ca_certs,
    )

    lifecycle: ServerLifecycle = app.state.lifecycle
    server = _Server(config, lifecycle.drain)

    def stop_after_failed_start() -> None:
        server.should_exit = True  # uvicorn shuts down as after a signal; the exit code says why

    lifecycle.on_failed = stop_after_failed_start
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits this way when the lifespan failed
        return exc.code if isinstance(exc.code, int) else 1
    if lifecycle.failure is not None:
        return 1
    return 0 if server.started else 1
