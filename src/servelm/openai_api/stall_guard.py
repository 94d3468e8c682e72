"""Slow-client protection for both HTTP fronts: a client that stops reading its response is cut
after `stall_timeout_s`, and a stream whose undelivered output grows past a bound is cut at once.

What already bounds a non-reading client, and what does not:

    engine ─▶ outputs queue (API process) ─▶ SSE write ─▶ uvicorn transport buffer ─▶ socket buffers ─▶ client
              unbounded: grows for as long      blocks ▲     ≤ 64 KiB, then `send`       kernel's, ≤ a few MB
              as the engine generates                  └──── waits (uvicorn's flow control)

uvicorn's flow control keeps its own buffer small: once the transport holds 64 KiB, the app's next
`send` waits until the client reads. The stream then stops taking outputs, but the engine goes on
generating into the request's queue, so the API process holds the whole remaining output (every
choice, every logprob) and the request its KV blocks until it ends, then the queue until the client
goes away, which a client that keeps its socket open and never reads never does. In the router the
same wait stops it reading the replica (backpressure, so no buffering there), but a stalled client
holds a router connection, a replica connection and the replica's request for ever.

Here every `send` on a generation route is timed. A sweeper (one per app, every CHECK_INTERVAL_S
at most, alive only while some response is watched) cuts a response whose `send` has waited
longer than `stall_timeout_s` — the client took no byte for that long — or whose handler's
`backlog` (the server: engine outputs queued for it) exceeds `max_backlog`. A cut calls the
handler's `on_cut` (the server aborts the request in the engine at once: its KV blocks free) and
cancels the request's ASGI call; its own cleanup then runs as for a client that left (the router
closes the upstream stream, which aborts the request on the replica). The connection is closed
without the response's end: uvicorn logs "ASGI callable returned without completing response",
after our warning saying why. A `send` that returns in time, however slowly the client reads
overall, never counts against the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.openai_api.overload import client_address

logger = logging.getLogger(__name__)
WATCH_STATE = "servelm_stream_watch"  # scope["state"] key of the request's StreamWatch
CHECK_INTERVAL_S = 0.25


@dataclass(eq=False)
class StreamWatch:
    """One response under watch. The handler may `attach` what it buffers and how to stop it."""

    sending_since: float | None = None  # monotonic start of the `send` now waiting; None: none is
    backlog: Callable[[], int] | None = None  # what the handler holds undelivered (the server: engine outputs)
    on_cut: Callable[[], None] | None = None  # stop producing (the server: abort the request in the engine)
    cut_reason: str | None = None
    _deadline: asyncio.Timeout | None = None

    def attach(self, backlog: Callable[[], int] | None = None, on_cut: Callable[[], None] | None = None) -> None:
        self.backlog, self.on_cut = backlog, on_cut

    def overdue(self, now: float, stall_timeout_s: float, max_backlog: int | None) -> str | None:
        """Why this response must be cut now, or None."""
        if self.sending_since is not None and now - self.sending_since > stall_timeout_s:
            return f"the client took no data for {now - self.sending_since:.1f} s (--stream-stall-timeout-s {stall_timeout_s:g})"
        if max_backlog is not None and self.backlog is not None and (queued := self.backlog()) > max_backlog:
            return f"{queued} outputs wait for a client that does not keep up (--max-stream-backlog {max_backlog})"
        return None

    def cut(self, reason: str) -> None:
        """Stop the handler and cancel the request's ASGI call (from the sweeper, on the same loop)."""
        if self.cut_reason is not None or self._deadline is None:
            return
        self.cut_reason = reason
        if self.on_cut is not None:
            self.on_cut()
        self._deadline.reschedule(asyncio.get_running_loop().time())  # expires at once: cancels the call


def stream_watch(state: object) -> StreamWatch | None:
    """The StreamWatch of a request (`request.state`), None where no guard watches it."""
    return getattr(state, WATCH_STATE, None)


class StallGuardMiddleware:
    """Watches the responses of `paths` (see the module docstring). `stall_timeout_s` None: off."""

    def __init__(
        self,
        app: ASGIApp,
        paths: Collection[str],
        stall_timeout_s: float | None,
        max_backlog: int | None = None,
        record_cut: Callable[[], None] | None = None,  # counts cuts (metrics)
    ) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.stall_timeout_s = stall_timeout_s
        self.max_backlog = max_backlog
        self.record_cut = record_cut
        self._watches: set[StreamWatch] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths or self.stall_timeout_s is None:
            await self.app(scope, receive, send)
            return
        watch = StreamWatch()
        scope.setdefault("state", {})[WATCH_STATE] = watch

        async def timed_send(message: Message) -> None:
            watch.sending_since = time.monotonic()
            try:
                await send(message)
            finally:
                watch.sending_since = None

        self._watches.add(watch)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="stall-guard")
        try:
            async with asyncio.timeout(None) as deadline:
                watch._deadline = deadline
                await self.app(scope, receive, timed_send)
        except TimeoutError:
            if watch.cut_reason is None:
                raise  # not ours: an expiry of the app's own
            logger.warning("%s %s from %s cut: %s", scope.get("method"), scope["path"], client_address(scope),
                           watch.cut_reason)  # fmt: skip
            if self.record_cut is not None:
                self.record_cut()
        finally:
            self._watches.discard(watch)

    async def _sweep(self) -> None:
        assert self.stall_timeout_s is not None
        interval = min(CHECK_INTERVAL_S, self.stall_timeout_s / 4)
        while self._watches:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for watch in list(self._watches):
                reason = watch.overdue(now, self.stall_timeout_s, self.max_backlog)
                if reason is not None:
                    with contextlib.suppress(RuntimeError):  # the call ended meanwhile: its deadline is spent
                        watch.cut(reason)
