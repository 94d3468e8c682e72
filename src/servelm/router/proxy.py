"""Forwarding one request to a replica: choose, send, retry once before the first byte, stream.

    body ─▶ RequestView ─▶ policy.choose ─▶ POST replica ─▶ first chunk? ──yes──▶ stream the rest as it comes
                               ▲                              │ no (connect error, reset, 429/502/503/504,
                               │                              │     or the replica left rotation meanwhile)
                               └──── another replica ◀────────┘ (once; the failed one is marked down)

A disaggregated request (disagg.py decides) sends its prefill to a prefill worker in the
background and the request itself, told where to pull the prompt's KV, to the decode worker,
whose answer is what the client sees (prefill_calls.py). A retry is always served whole.

"Before the first byte" is literal: the upstream's first body chunk is awaited before the
client gets the status line, so a replica that dies while prefilling (or while computing a
non-streamed answer) costs a retry, not an error; so does one that stops answering (a frozen
process) once the health checker takes it out of rotation. A client that leaves during that wait
has the upstream request closed (the replica aborts it). After the first byte, a stream of one
choice (continuation.migratable) is relayed event by event and continued on another replica if
its replica fails (migration.py); its replica is asked for the token ids behind the text
(`return_token_ids`), which the client sees only if it asked too. Anything else is passed through
unchanged as it comes (`aiter_raw`; an event stream in whole events): a failure cuts a body, and
ends an event stream with an error event and [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from servelm.openai_api.errors import SERVER_ERROR, error_response
from servelm.router.continuation import migratable
from servelm.router.disagg import DisaggPlan, plan_request
from servelm.router.migration import Leg, MigratingStream
from servelm.router.policies import Decision, RequestView
from servelm.router.prefill_calls import PrefillCalls, decode_body, prefill_body
from servelm.router.relay import StreamRelay, replica_lost_events
from servelm.router.replicas import Replica
from servelm.router.request_view import build_view
from servelm.router.state import Router
from servelm.tokenization.prompt_tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")
# The replica is going away (502/503/504) or its waiting queue is full (429): another may serve.
RETRY_STATUSES = {429, 502, 503, 504}
# Hop-by-hop (RFC 9110 §7.6.1) or recomputed by the HTTP stack: never forwarded.
_DROP_REQUEST_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"}
_DROP_RESPONSE_HEADERS = {"connection", "keep-alive", "transfer-encoding", "upgrade", "date", "server"}
REPLICA_HEADER = "x-servelm-replica"
DISAGG_HEADER = "x-servelm-disagg"  # the split decision's reason (disagg.py)
PREFILL_REPLICA_HEADER = "x-servelm-prefill-replica"  # where the prompt was computed, when split
QUERY_TIMEOUT_S = 10.0  # a migration's /detokenize and /v1/models calls (the client's stream waits on them)


@dataclass
class _Failure:
    """Why an attempt failed before the first byte; `status` when the replica answered at all."""

    message: str
    status: int | None = None
    retry_after: str | None = None


@dataclass
class _Attempt:
    """A replica's answer, its first body chunk read; counted in the replica's load until released."""

    replica: Replica
    response: httpx.Response
    first_chunk: bytes
    chunks: AsyncIterator[bytes]
    tokens: int  # what it added to replica.outstanding_tokens
    prefill: asyncio.Task[float | None] | None = None  # a disaggregated request's prefill call
    released: bool = False

    async def release(self) -> None:
        """Close the response (a replica aborts a request whose client left) and uncount it. Once."""
        if self.released:
            return
        self.released = True
        await self.response.aclose()
        self.replica.in_flight -= 1
        self.replica.outstanding_tokens -= self.tokens
        if self.prefill is not None:
            self.prefill.cancel()  # no-op once it returned; else the client left (or the decode worker gave up on it)

    @property
    def is_event_stream(self) -> bool:
        content_type = self.response.headers.get("content-type", "")
        return self.response.status_code == 200 and content_type.startswith("text/event-stream")


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
        path = request.url.path
        view = await build_view(self.tokenizer, self.router.options.block_size, path, body, headers,
                                self.router.replicas.adapter_names())  # fmt: skip
        migrate = self.router.options.max_migrations > 0 and migratable(path, body)
        upstream_body = body
        if migrate and body.get("return_token_ids") is not True:
            upstream_body = {**body, "return_token_ids": True}
            raw = json.dumps(upstream_body).encode()
        routed = await _unless_client_leaves(
            request, self.route(view, path, raw, upstream_body, headers, exclude=set(), first_reason=None)
        )
        if routed is None:  # the client left while the answer was computed: the replica aborted it
            return Response(status_code=499)
        if isinstance(routed, list):
            return _give_up(routed)
        attempt, plan = routed
        if not (migrate and attempt.is_event_stream):
            return self._stream(attempt, plan)
        upstream = _Continuations(self, headers)
        options = self.router.options
        stream = MigratingStream(StreamRelay(path, body), attempt, upstream, path, body, upstream_body,
                                 options.max_migrations, options.upstream_stall_timeout_s, self.router.metrics)  # fmt: skip
        return _ReleasingStream(stream.body(), stream.release, status_code=attempt.response.status_code,
                                headers=_response_headers(attempt, plan))  # fmt: skip

    async def route(
        self, view: RequestView, path: str, raw: bytes, body: dict[str, Any], headers: dict[str, str],
        exclude: set[str], first_reason: str | None,
    ) -> tuple[_Attempt, DisaggPlan] | list[_Failure]:  # fmt: skip
        """Up to max_attempts replicas not in `exclude`, until one answers (its first chunk read).
        `first_reason` labels the first attempt's decision when it is not the policy's own (a
        migration); later attempts are retries. Returns the attempt, or why each one failed."""
        tried = set(exclude)
        failures: list[_Failure] = []
        options = self.router.options
        for attempt in range(options.max_attempts):
            candidates = [r for r in self.router.replicas.healthy()
                          if r.url not in tried and r.serves_model(view.lora_name)]  # fmt: skip
            reason = "retry" if attempt > 0 else first_reason
            plan = plan_request(view, candidates, self.router.policy, self.router.cached_blocks,
                                options.disagg_settings(), options.block_size, retry=reason is not None)  # fmt: skip
            if plan is None:
                break
            tried.add(plan.decode.url)
            self._record_decision(plan.route, view, reason)
            self.router.metrics.disagg_decisions.labels(plan.decision, plan.reason).inc()
            result = await self._dispatch(plan, view, path, raw, body, headers)
            if isinstance(result, _Attempt):
                return result, plan
            failures.append(result)
        return failures

    async def _dispatch(
        self, plan: DisaggPlan, view: RequestView, path: str, raw: bytes, body: dict[str, Any], headers: dict[str, str]
    ) -> _Attempt | _Failure:
        """One attempt: the request whole (its bytes untouched), or split into the prefill call
        (background) and the decode request (awaited to its first byte, as `_try`). The prefill
        is cancelled when the decode attempt fails or this coroutine is cancelled."""
        if plan.prefill is None or plan.prefill.transfer_address is None:
            return await self._try(plan.decode, view, path, raw, headers)
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
            return result
        if prefill.done() and not prefill.cancelled() and (prefill_done := prefill.result()) is not None:
            # The hop the split adds after the prefill: the pull's last blocks and the first step there.
            self.router.metrics.disagg_handoff.observe(max(0.0, time.monotonic() - prefill_done))
        result.prefill = prefill
        return result

    def _record_decision(self, decision: Decision, view: RequestView, reason: str | None) -> None:
        metrics = self.router.metrics
        if reason == "retry":
            metrics.retries.inc()
        metrics.decisions.labels(reason or decision.reason).inc()
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
            opened = await _unless_set(replica.out_of_rotation, self._open(upstream))
            if opened is None:
                failure = _Failure(f"{replica.url} left rotation before it answered")
            else:
                response, chunks, first = opened
                if response.status_code in RETRY_STATUSES:
                    failure = _Failure(f"{replica.url} answered {response.status_code}", response.status_code,
                                       response.headers.get("retry-after"))  # fmt: skip
                else:
                    return _Attempt(replica, response, first, chunks, tokens)
        except httpx.HTTPError as exc:
            failure = _Failure(f"{replica.url}: {type(exc).__name__}: {exc}")
            self.router.metrics.failures.labels(replica.url).inc()
            await self.router.mark_down(replica, failure.message)
        except BaseException:  # cancelled: the client left, or the router stops
            _uncount(replica, tokens)
            if response is not None:
                with anyio.CancelScope(shield=True):
                    await response.aclose()
            raise
        # Failed before any byte reached the client: release and let the caller retry.
        if response is not None:
            await response.aclose()
        _uncount(replica, tokens)
        logger.warning("attempt failed before the first byte: %s", failure.message)
        return failure

    async def _open(self, upstream: httpx.Request) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
        """Send; the response, its body's chunks and the first chunk (none read when the status
        says to retry). Cancelled, it closes what it opened."""
        response = await self.client.send(upstream, stream=True)
        try:
            chunks = response.aiter_raw()
            first = b"" if response.status_code in RETRY_STATUSES else await anext(chunks, b"")
            return response, chunks, first
        except BaseException:
            with anyio.CancelScope(shield=True):
                await response.aclose()
            raise

    def _stream(self, attempt: _Attempt, plan: DisaggPlan) -> StreamingResponse:
        """Pass the answer through as it comes."""
        events = attempt.is_event_stream

        async def body() -> AsyncIterator[bytes]:
            # An event stream goes out in whole events, so a replica lost mid-stream can be followed
            # by an error event and [DONE] (what the OpenAI clients raise, not a broken connection).
            held = b""
            try:
                async for chunk in _chained(attempt.first_chunk, attempt.chunks):
                    if events:
                        held += chunk
                        end = held.rfind(b"\n\n")
                        if end == -1:
                            continue  # no event complete yet
                        chunk, held = held[: end + 2], held[end + 2 :]
                    if chunk:
                        yield chunk
                if held:
                    yield held  # a last event without its blank line (replicas write none)
            except httpx.HTTPError as exc:
                # Mid-stream: too late to retry (a stream of several choices cannot move).
                self.router.metrics.failures.labels(attempt.replica.url).inc()
                reason = f"stream broke: {type(exc).__name__}: {exc}"
                await self.router.mark_down(attempt.replica, reason)
                if not events:
                    raise  # a body cut short must reach the client as one: the connection is dropped
                logger.warning("%s: the client's stream ends with an error event", reason)
                message = f"the replica serving this stream failed ({type(exc).__name__}); the stream cannot go on"
                yield b"".join(replica_lost_events(message))

        return _ReleasingStream(body(), attempt.release, status_code=attempt.response.status_code,
                                headers=_response_headers(attempt, plan))  # fmt: skip

    async def get_any(self, path: str, headers: dict[str, str]) -> Response:
        """GET a read-only endpoint (/v1/models) from the first healthy replica that answers."""
        return await self._first_answer(lambda url: self.client.get(url + path, headers=headers))

    async def post_any(self, request: Request) -> Response:
        """POST a stateless query (/tokenize, /detokenize) to the first healthy replica that answers."""
        content, headers, path = await request.body(), request_headers(request), request.url.path
        return await self._first_answer(lambda url: self.client.post(url + path, content=content, headers=headers))

    async def post_all(self, request: Request) -> tuple[Response, list[Replica]]:
        """POST to every healthy replica at once (run-time LoRA loads and unloads, which each must
        hear): the first error answer if any replica refused (or could not be reached), else the
        first 200; with the replicas that answered 200."""
        content, headers, path = await request.body(), request_headers(request), request.url.path
        replicas = self.router.replicas.healthy()
        if not replicas:
            return error_response(503, "no healthy replica", type=SERVER_ERROR, code="no_replica_available",
                                  headers={"Retry-After": "1"}), []  # fmt: skip
        answers = await asyncio.gather(*(self.client.post(r.url + path, content=content, headers=headers)
                                         for r in replicas), return_exceptions=True)  # fmt: skip
        done = [r for r, a in zip(replicas, answers, strict=True) if isinstance(a, httpx.Response) and a.status_code == 200]
        for replica, answer in zip(replicas, answers, strict=True):
            if isinstance(answer, BaseException):
                await self.router.mark_down(replica, f"{type(answer).__name__}: {answer}")
                message = f"replica {replica.url} could not be reached ({type(answer).__name__}); the others answered"
                return error_response(502, message, type=SERVER_ERROR, code="replica_unreachable"), done
            if answer.status_code != 200:
                return Response(answer.content, status_code=answer.status_code,
                                media_type=answer.headers.get("content-type")), done  # fmt: skip
        first = answers[0]
        assert isinstance(first, httpx.Response)
        return Response(first.content, status_code=200, media_type=first.headers.get("content-type")), done

    async def _first_answer(self, send: Callable[[str], Awaitable[httpx.Response]]) -> Response:
        for replica in self.router.replicas.healthy():
            try:
                response = await send(replica.url)
            except httpx.HTTPError as exc:
                await self.router.mark_down(replica, f"{type(exc).__name__}: {exc}")
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))  # fmt: skip
        return error_response(503, "no healthy replica", type=SERVER_ERROR, code="no_replica_available",
                              headers={"Retry-After": "1"})  # fmt: skip


def _response_headers(attempt: _Attempt, plan: DisaggPlan) -> dict[str, str]:
    headers = {k: v for k, v in attempt.response.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS}
    headers[REPLICA_HEADER] = attempt.replica.url  # the first leg's, for a stream that migrates later
    headers[DISAGG_HEADER] = plan.reason
    if plan.prefill is not None:
        headers[PREFILL_REPLICA_HEADER] = plan.prefill.url
    return headers


def _uncount(replica: Replica, tokens: int) -> None:
    replica.in_flight -= 1
    replica.outstanding_tokens -= tokens


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
                          code="no_replica_available", headers={"Retry-After": "1"})  # fmt: skip


async def _chained(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


async def _unless_set(event: asyncio.Event, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (it is cancelled) if `event` is set first."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (it is cancelled: an upstream request it has open is closed, and
    the replica aborts it) if the client disconnects first. The body must have been read: what
    the client sends after it is only the disconnect."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.ensure_future(watch())
    try:
        return await _unless_set(gone, work)
    finally:
        watcher.cancel()


class _Continuations:
    """The proxy as a migrating stream's Upstream (migration.py), for one request."""

    def __init__(self, proxy: Proxy, headers: dict[str, str]) -> None:
        self.proxy = proxy
        self.headers = headers  # the client's: the continuation is its request
        # Tokenize / model queries carry the client's credentials only.
        self.query_headers = {k: v for k, v in headers.items() if k.lower() == "authorization"}

    async def send(self, path: str, body: dict[str, Any], exclude: set[str]) -> Leg | None:
        proxy = self.proxy
        view = await build_view(proxy.tokenizer, proxy.router.options.block_size, path, body, self.headers,
                                proxy.router.replicas.adapter_names())  # fmt: skip
        raw = json.dumps(body).encode()
        routed = await proxy.route(view, path, raw, body, self.headers, exclude, first_reason="migration")
        if isinstance(routed, list):
            logger.warning("no replica took the continuation: %s", routed[-1].message if routed else "none healthy")
            return None
        attempt, _ = routed
        if not attempt.is_event_stream:
            logger.error("%s refused the continuation (%d): %s", attempt.replica.url, attempt.response.status_code,
                         attempt.first_chunk[:500].decode(errors="replace"))  # fmt: skip
            await attempt.release()
            return None
        return attempt

    async def detokenize(self, url: str, token_ids: list[int], skip_special_tokens: bool) -> str | None:
        body = {"tokens": token_ids, "skip_special_tokens": skip_special_tokens}
        try:
            response = await self.proxy.client.post(f"{url}/detokenize", json=body, headers=self.query_headers,
                                                    timeout=QUERY_TIMEOUT_S)  # fmt: skip
            response.raise_for_status()
            text = response.json()["prompt"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.warning("detokenize on %s failed: %s", url, exc)
            return None
        return text if isinstance(text, str) else None

    async def context_window(self, exclude: set[str]) -> int | None:
        for replica in self.proxy.router.replicas.healthy():
            if replica.url in exclude:
                continue
            try:
                response = await self.proxy.client.get(f"{replica.url}/v1/models", headers=self.query_headers,
                                                       timeout=QUERY_TIMEOUT_S)  # fmt: skip
                window = response.json()["data"][0]["max_model_len"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                logger.warning("no context window from %s: %s", replica.url, exc)
                continue
            if isinstance(window, int):
                return window
        return None

    async def broke(self, leg: Leg, reason: str, transport: bool) -> None:
        router = self.proxy.router
        router.metrics.failures.labels(leg.replica.url).inc()
        if transport:
            await router.mark_down(leg.replica, f"stream broke: {reason}")


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
