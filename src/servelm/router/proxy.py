"""Forwarding one request to a replica: choose, send, retry once before the first byte, stream.

    body ─▶ RequestView ─▶ policy.choose ─▶ POST replica ─▶ first chunk? ──yes──▶ stream the rest as it comes
                               ▲                              │ no (connect error, reset, 429/502/503/504)
                               └──── another replica ◀────────┘ (once; the failed one is marked down)

A disaggregated request (disagg.py decides) sends its prefill to a prefill worker in the
background and the request itself, told where to pull the prompt's KV, to the decode worker,
whose answer is what the client sees (prefill_calls.py). A retry is always served whole.

"Before the first byte" is literal: the upstream's first body chunk is awaited before the
client gets the status line, so a replica that dies while prefilling (or while computing a
non-streamed answer) costs a retry, not an error. After that, bytes are passed through
unchanged and unbuffered (`aiter_raw`), and a failure can only cut the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from servelm.openai_api.errors import SERVER_ERROR, error_response
from servelm.router.disagg import DisaggPlan, plan_request
from servelm.router.policies import Decision, RequestView
from servelm.router.prefill_calls import PrefillCalls, decode_body, prefill_body
from servelm.router.replicas import Replica
from servelm.router.request_view import build_view
from servelm.router.state import Router
from servelm.tokenization.prompt_tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)
# The replica is going away (502/503/504) or its waiting queue is full (429): another may serve.
RETRY_STATUSES = {429, 502, 503, 504}
# Hop-by-hop (RFC 9110 §7.6.1) or recomputed by the HTTP stack: never forwarded.
_DROP_REQUEST_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"}
_DROP_RESPONSE_HEADERS = {"connection", "keep-alive", "transfer-encoding", "upgrade", "date", "server"}
REPLICA_HEADER = "x-servelm-replica"
DISAGG_HEADER = "x-servelm-disagg"  # the split decision's reason (disagg.py)
PREFILL_REPLICA_HEADER = "x-servelm-prefill-replica"  # where the prompt was computed, when split


@dataclass
class _Failure:
    """Why an attempt failed before the first byte; `status` when the replica answered at all."""

    message: str
    status: int | None = None
    retry_after: str | None = None


@dataclass
class _Attempt:
    replica: Replica
    response: httpx.Response
    first_chunk: bytes
    chunks: AsyncIterator[bytes]


class Proxy:
    def __init__(self, router: Router, client: httpx.AsyncClient, tokenizer: PromptTokenizer | None) -> None:
        self.router = router
        self.client = client
        self.tokenizer = tokenizer
        self.prefill_calls = PrefillCalls(router, client)

    async def close(self) -> None:
        await self.prefill_calls.close()

    async def forward(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        headers = request_headers(request)
        view = await build_view(self.tokenizer, self.router.options.block_size, request.url.path, body, headers)
        tried: set[str] = set()
        failures: list[_Failure] = []
        options = self.router.options
        for attempt in range(options.max_attempts):
            candidates = [r for r in self.router.replicas.healthy() if r.url not in tried]
            plan = plan_request(view, candidates, self.router.policy, self.router.cached_blocks,
                                options.disagg_settings(), options.block_size, retry=attempt > 0)  # fmt: skip
            if plan is None:
                break
            tried.add(plan.decode.url)
            self._record_decision(plan.route, view, retry=attempt > 0)
            self.router.metrics.disagg_decisions.labels(plan.decision, plan.reason).inc()
            result, prefill = await self._dispatch(plan, view, request.url.path, raw, body, headers)
            if isinstance(result, _Attempt):
                return self._stream(result, view, plan, prefill)
            failures.append(result)
        return _give_up(failures)

    async def _dispatch(
        self, plan: DisaggPlan, view: RequestView, path: str, raw: bytes, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[_Attempt | _Failure, asyncio.Task[float | None] | None]:
        """One attempt: the request whole (its bytes untouched), or split into the prefill call
        (background) and the decode request (awaited to its first byte, as `_try`). The prefill
        is cancelled when the decode attempt fails or this coroutine is cancelled."""
        if plan.prefill is None or plan.prefill.transfer_address is None:
            return await self._try(plan.decode, view, path, raw, headers), None
        transfer_id = uuid.uuid4().hex
        prefill_content = json.dumps(prefill_body(body, transfer_id)).encode()
        prefill = self.prefill_calls.start(plan.prefill, path, prefill_content, headers)
        decode_content = json.dumps(decode_body(body, transfer_id, plan.prefill.transfer_address)).encode()
        try:
            result = await self._try(plan.decode, view, path, decode_content, headers)
        except BaseException:
            prefill.cancel()
            raise
        if isinstance(result, _Failure):
            prefill.cancel()
            return result, None
        if prefill.done() and not prefill.cancelled() and (prefill_done := prefill.result()) is not None:
            # The hop the split adds after the prefill: the pull's last blocks and the first step there.
            self.router.metrics.disagg_handoff.observe(max(0.0, time.monotonic() - prefill_done))
        return result, prefill

    def _record_decision(self, decision: Decision, view: RequestView, retry: bool) -> None:
        metrics = self.router.metrics
        if retry:
            metrics.retries.inc()
        metrics.decisions.labels("retry" if retry else decision.reason).inc()
        metrics.requests.labels(decision.replica.url).inc()
        block_size = self.router.options.block_size
        metrics.prefix_match_tokens.observe(min(decision.matched_blocks * block_size, view.num_prompt_tokens))
        for medium, num_blocks in decision.match.by_medium().items():
            if num_blocks:
                metrics.matched_blocks.labels(medium).inc(num_blocks)

    async def _try(
        self, replica: Replica, view: RequestView, path: str, raw: bytes, headers: dict[str, str]
    ) -> _Attempt | _Failure:
        """Send and wait for the first body chunk. Returns the live attempt, or why it failed."""
        tokens = view.num_prompt_tokens + view.num_output_tokens
        replica.in_flight += 1
        replica.outstanding_tokens += tokens
        replica.num_requests += 1
        response: httpx.Response | None = None
        try:
            upstream = self.client.build_request("POST", replica.url + path, content=raw, headers=headers)
            response = await self.client.send(upstream, stream=True)
            if response.status_code in RETRY_STATUSES:
                failure = _Failure(f"{replica.url} answered {response.status_code}", response.status_code,
                                   response.headers.get("retry-after"))  # fmt: skip
            else:
                chunks = response.aiter_raw()
                first = await anext(chunks, b"")
                return _Attempt(replica, response, first, chunks)
        except httpx.HTTPError as exc:
            failure = _Failure(f"{replica.url}: {type(exc).__name__}: {exc}")
            self.router.metrics.failures.labels(replica.url).inc()
            await self.router.mark_down(replica, failure.message)
        # Failed before any byte reached the client: release and let the caller retry.
        if response is not None:
            await response.aclose()
        replica.in_flight -= 1
        replica.outstanding_tokens -= tokens
        logger.warning("attempt failed before the first byte: %s", failure.message)
        return failure

    def _stream(
        self, attempt: _Attempt, view: RequestView, plan: DisaggPlan, prefill: asyncio.Task[float | None] | None
    ) -> StreamingResponse:
        replica, response = attempt.replica, attempt.response
        tokens = view.num_prompt_tokens + view.num_output_tokens

        async def body() -> AsyncIterator[bytes]:
            try:
                if attempt.first_chunk:
                    yield attempt.first_chunk
                async for chunk in attempt.chunks:
                    yield chunk
            except httpx.HTTPError as exc:
                # Mid-stream: too late to retry; the client sees the stream cut.
                self.router.metrics.failures.labels(replica.url).inc()
                await self.router.mark_down(replica, f"stream broke: {type(exc).__name__}: {exc}")
                raise

        async def release() -> None:
            await response.aclose()  # a client gone mid-stream: closing aborts the request on the replica
            replica.in_flight -= 1
            replica.outstanding_tokens -= tokens
            if prefill is not None:
                prefill.cancel()  # no-op once it returned; else the client left (or the decode worker gave up on it)

        headers = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS}
        headers[REPLICA_HEADER] = replica.url
        headers[DISAGG_HEADER] = plan.reason
        if plan.prefill is not None:
            headers[PREFILL_REPLICA_HEADER] = plan.prefill.url
        return _ReleasingStream(body(), release, status_code=response.status_code, headers=headers)

    async def get_any(self, path: str, headers: dict[str, str]) -> Response:
        """GET a read-only endpoint (/v1/models) from the first healthy replica that answers."""
        for replica in self.router.replicas.healthy():
            try:
                response = await self.client.get(replica.url + path, headers=headers)
            except httpx.HTTPError as exc:
                await self.router.mark_down(replica, f"{type(exc).__name__}: {exc}")
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))  # fmt: skip
        return error_response(503, "no healthy replica", type=SERVER_ERROR, code="no_replica_available")


def _give_up(failures: list[_Failure]) -> Response:
    """Every attempt failed. If every replica tried was merely full (429), so is the fleet: the
    client gets 429 and the shortest Retry-After a replica asked for; anything else is a 503."""
    if failures and all(f.status == 429 for f in failures):
        waits = [int(f.retry_after) for f in failures if f.retry_after and f.retry_after.isdigit()]
        response = error_response(429, "Every replica tried is at capacity; retry later.", type="rate_limit_error",
                                  code="rate_limit_exceeded")  # fmt: skip
        response.headers["Retry-After"] = str(min(waits) if waits else 1)
        return response
    last = failures[-1].message if failures else "no healthy replica"
    return error_response(503, f"no replica could serve the request: {last}", type=SERVER_ERROR,
                          code="no_replica_available")  # fmt: skip


class _ReleasingStream(StreamingResponse):
    """A StreamingResponse that runs `release` exactly once however it ends.

    A generator's own `finally` is not enough: when the client disconnects before the
    body is first iterated, Starlette never starts the generator, so its `finally` never
    runs and the replica's load count and upstream connection would leak.
    """

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # it must complete even while being cancelled
                await self._release()


def request_headers(request: Request) -> dict[str, Any]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST_HEADERS}
