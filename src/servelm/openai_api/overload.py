"""The overload flags both HTTP fronts (`servelm serve`, `servelm router`) take, and what they share
to apply them: which routes generate, and who a client is.

    --max-concurrent-requests N             generation requests in flight beyond which new ones get 429
    --max-concurrent-requests-per-client N  the same, per client address
    --stream-stall-timeout-s S              a response whose client took no byte for S s is cut

In flight means let in and not yet answered to the last byte (tenancy/limits.py). The server's
--max-waiting-requests is a different bound: it counts engine requests *waiting* for the engine
(prompts x n) and is checked once the body is parsed; these count HTTP requests whatever they do —
waiting, running, or streaming out to a slow client, which no engine queue sees — and are checked
before the body is read. Both apply; a request must pass each.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
DEFAULT_STALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class OverloadOptions:
    max_concurrent_requests: int | None = None  # None: no limit
    max_concurrent_requests_per_client: int | None = None
    stream_stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S  # None: never cut

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_concurrent_requests_per_client"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.stream_stall_timeout_s is not None and self.stream_stall_timeout_s <= 0:
            raise ValueError(f"--stream-stall-timeout-s must be positive (0 on the command line: never), "
                             f"got {self.stream_stall_timeout_s}")  # fmt: skip

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OverloadOptions:
        stall = args.stream_stall_timeout_s
        return cls(args.max_concurrent_requests, args.max_concurrent_requests_per_client, stall or None)


def add_overload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-concurrent-requests", type=int, default=None, metavar="N",
        help="generation requests in flight (waiting, running or streaming out) beyond which new ones get 429 "
        "with Retry-After, before their body is read (default: no limit)",
    )  # fmt: skip
    parser.add_argument(
        "--max-concurrent-requests-per-client", type=int, default=None, metavar="N",
        help="the same limit per client address (a proxy's X-Forwarded-For names the client when the proxy "
        "is trusted: 127.0.0.1 or $FORWARDED_ALLOW_IPS, uvicorn's)",
    )  # fmt: skip
    parser.add_argument(
        "--stream-stall-timeout-s", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="S",
        help="cut a response whose client has taken no byte for S seconds; its request is aborted and "
        "frees its KV blocks (0: never)",
    )  # fmt: skip


def client_address(scope: Scope) -> str:
    """Who sent the request: its peer's address (uvicorn puts a trusted proxy's X-Forwarded-For there:
    a proxy on 127.0.0.1, or one listed in $FORWARDED_ALLOW_IPS)."""
    client = scope.get("client")
    return str(client[0]) if client else ""


class GenerationGate:
    """ASGI middleware that admits each generation request before the app sees it (and before its
    body is read): `admit` returns the scope to go on with and how to release the request once its
    call ends (however it ends), or the response that refuses it. Other routes pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def admit(self, scope: Scope) -> tuple[Scope, Callable[[], None]] | Response:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        admitted = self.admit(scope)
        if isinstance(admitted, Response):
            await admitted(scope, receive, send)
            return
        scope, release = admitted
        try:
            await self.app(scope, receive, send)
        finally:
            release()
