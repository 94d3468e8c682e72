"""A client stream that outlives the replica serving it.

    leg (a replica's SSE response) ─▶ events ─▶ StreamRelay.handle ─▶ client
        │ the leg fails before [DONE]: connection reset or closed, no byte for stall_timeout_s,
        │ an error event, a choice finished by "error"/"abort" (its engine died, it shut down)
        ▼
    finish already sent?  ── yes ─▶ write the lost tail (usage, [DONE])
        │ no
    migrations left?      ── no ──▶ an error event, [DONE]
        │ yes
    continuation (continuation.py) on a replica not yet failed ─▶ the next leg; its first events
    are joined to what the client has across the token boundary (relay.py, splice.py)

A leg that fails before any event was received is sent again whole, as the proxy's retry would
(the client has the status line only). Each leg is released as soon as it is given up: closing its
response aborts the request on its replica. One MigratingStream per request, on the router's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any, Protocol

import httpx

from servelm.router.continuation import COMPLETIONS_PATH, continuation_body, output_limit, remaining_tokens
from servelm.router.metrics import RouterMetrics
from servelm.router.relay import RelayResult, StreamRelay
from servelm.router.replicas import Replica
from servelm.router.sse import EventSplitter

logger = logging.getLogger(__name__)

# Why a leg failed: the label of servelm:router_migrations_total.
CONNECTION, CLOSED, STALLED, REPLICA_ERROR = "connection", "closed", "stalled", "replica_error"
# Why a stream could not go on: the label of servelm:router_migration_failures_total.
NO_BUDGET, NO_REPLICA, NO_PROMPT = "budget", "no_replica", "unknown_prompt"


class Leg(Protocol):
    """One upstream response of the stream (the proxy's attempt)."""

    replica: Replica
    first_chunk: bytes
    chunks: AsyncIterator[bytes]

    async def release(self) -> None:
        """Close it (the replica aborts the request) and uncount its load; safe to repeat."""


class Upstream(Protocol):
    """The proxy's side of one request."""

    async def send(self, path: str, body: dict[str, Any], exclude: set[str]) -> Leg | None:
        """A new leg on a healthy replica not in `exclude` (trying another before the first byte
        as any request does); None when none answered with a stream."""

    async def detokenize(self, url: str, token_ids: list[int], skip_special_tokens: bool) -> str | None:
        """The replica's text of `token_ids` (/detokenize); None when it did not answer."""

    async def context_window(self, exclude: set[str]) -> int | None:
        """The replicas' max_model_len."""

    async def broke(self, leg: Leg, reason: str, transport: bool) -> None:
        """Count the failure; a transport failure also takes the replica out of rotation."""


class MigratingStream:
    def __init__(
        self, relay: StreamRelay, first: Leg, upstream: Upstream, path: str, body: Mapping[str, Any],
        upstream_body: dict[str, Any], max_migrations: int, stall_timeout_s: float | None, metrics: RouterMetrics,
    ) -> None:  # fmt: skip
        self.relay = relay
        self.leg: Leg | None = first
        self.upstream = upstream
        self.path = path
        self.request_body = body  # the client's
        self.upstream_body = upstream_body  # the client's with return_token_ids: what a whole re-send sends
        self.max_migrations = max_migrations
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics
        self.failed: set[str] = set()  # replicas whose leg failed: the last resort for this request's next leg
        self.migrations = 0
        self._lost_at: float | None = None  # when the last leg failed, until the next one's first event

    async def release(self) -> None:
        if self.leg is not None:
            await self.leg.release()

    async def body(self) -> AsyncIterator[bytes]:
        while self.leg is not None:
            leg = self.leg
            cause, reason = CLOSED, "the stream ended before [DONE]"
            try:
                async with contextlib.aclosing(self._events(leg)) as events:
                    async for data in events:
                        result = await self._step(leg, data)
                        if result.events:
                            self._note_resumed()
                            for event in result.events:
                                yield event
                        if result.done:
                            return
                        if result.failure is not None:
                            cause, reason = REPLICA_ERROR, result.failure
                            break
            except httpx.HTTPError as exc:
                cause, reason = CONNECTION, f"{type(exc).__name__}: {exc}"
            except TimeoutError:
                cause, reason = STALLED, f"no byte for {self.stall_timeout_s} s"
            for event in await self._after_failure(leg, cause, reason):
                yield event

    async def _events(self, leg: Leg) -> AsyncGenerator[bytes, None]:
        """The leg's events' data fields; TimeoutError when it stalls."""
        splitter = EventSplitter()
        for data in splitter.feed(leg.first_chunk):
            yield data
        while True:
            async with asyncio.timeout(self.stall_timeout_s):
                chunk = await anext(leg.chunks, None)
            if chunk is None:
                return
            for data in splitter.feed(chunk):
                yield data

    async def _step(self, leg: Leg, data: bytes) -> RelayResult:
        """One event, and the join across the boundary while the continuation's first ids need one."""
        result = self.relay.handle(data)
        ids = self.relay.splice_ids() if result.failure is None and not result.done else None
        if ids is None:
            return result
        skip = self.relay.skip_special_tokens
        texts = [await self.upstream.detokenize(leg.replica.url, token_ids, skip) for token_ids in ids]
        joined = self.relay.apply_splice(texts)
        return RelayResult(result.events + joined.events, joined.failure, joined.done)

    def _note_resumed(self) -> None:
        if self._lost_at is not None:
            self.metrics.migration_seconds.observe(time.monotonic() - self._lost_at)
            self._lost_at = None

    async def _after_failure(self, leg: Leg, cause: str, reason: str) -> list[bytes]:
        """Give the failed leg up; start the next one, or end the client's stream."""
        self.leg = None
        self.failed.add(leg.replica.url)
        await leg.release()
        await self.upstream.broke(leg, reason, transport=cause != REPLICA_ERROR)
        relay = self.relay
        if relay.finish_reason is not None:  # only the usage chunk and [DONE] were lost
            return relay.finish_tail()
        logger.warning("stream %s from %s failed after %d tokens (%s: %s)", relay.stream_id, leg.replica.url,
                       len(relay.sent_ids), cause, reason)  # fmt: skip
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        why = NO_BUDGET if self.migrations >= self.max_migrations else None
        if why is None and relay.started and not relay.can_continue:
            why = NO_PROMPT
        if why is None:
            self.migrations += 1
            self.leg = await self._next_leg(leg.replica.url)
            why = NO_REPLICA if self.leg is None else None
        if why is not None:
            self.metrics.migration_failures.labels(why).inc()
            logger.error("stream %s lost after %d tokens (%d continuations tried): %s", relay.stream_id,
                         len(relay.sent_ids), self.migrations, why)  # fmt: skip
            return relay.error_tail(f"The replica serving this stream failed ({cause}) and it could not be "
                                    f"continued elsewhere ({why}).")  # fmt: skip
        assert self.leg is not None
        self.metrics.migrations.labels(cause).inc()
        logger.warning("stream %s continued on %s after %d tokens (migration %d of at most %d)", relay.stream_id,
                       self.leg.replica.url, len(relay.sent_ids), self.migrations, self.max_migrations)  # fmt: skip
        return []

    async def _next_leg(self, just_failed: str) -> Leg | None:
        relay = self.relay
        if not relay.started:  # nothing reached the client: send the request again, whole
            return await self._send(self.path, self.upstream_body, just_failed)
        assert relay.prompt_ids is not None
        window = None
        if output_limit(self.path, self.request_body) is None:
            window = await self.upstream.context_window(self.failed)
            if window is None:
                return None
        remaining = remaining_tokens(self.path, self.request_body, len(relay.prompt_ids), len(relay.sent_ids), window)
        if remaining <= 0:  # it had all its tokens, the finish was lost with them: nothing to continue
            logger.error("a stream had all its tokens but no finish_reason; not continued")
            return None
        body = continuation_body(self.path, self.request_body, relay.prompt_ids, relay.sent_ids, remaining)
        leg = await self._send(COMPLETIONS_PATH, body, just_failed)
        if leg is not None:
            relay.begin_continuation()
        return leg

    async def _send(self, path: str, body: dict[str, Any], just_failed: str) -> Leg | None:
        """A replica this stream has not failed on yet; else one it failed on before and that is back in
        rotation (a reset connection does not mean a dead replica), never the one that just failed."""
        leg = await self.upstream.send(path, body, self.failed)
        if leg is None and self.failed != {just_failed}:
            leg = await self.upstream.send(path, body, {just_failed})
        return leg
