"""The router's own overload guard, in front of the proxy: requests in flight in all and per client
address (tenancy/limits.py's InFlightLimits, as the server counts them), refused with 429 and
Retry-After before the body is read; and the client's address passed on to the replicas.

    client ─▶ ApiKeyMiddleware ─▶ RouterLimitsMiddleware ─▶ BodyLimitMiddleware ─▶ StallGuardMiddleware ─▶ proxy
                                  (in flight; X-Forwarded-For)   (413)                (slow clients cut)

X-Forwarded-For gets the client's address appended (as a proxy should), so a replica's own
per-client limit counts the client, not the router: uvicorn believes the header from the peers in
$FORWARDED_ALLOW_IPS (127.0.0.1 by default). Set per-client limits on the router, though: a
replica sees only its own share of a client's requests.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Scope

from servelm.openai_api.errors import error_response
from servelm.openai_api.overload import GenerationGate, client_address
from servelm.tenancy.limits import InFlightLimits, LimitExceeded

FORWARDED_FOR = b"x-forwarded-for"


class RouterLimitsMiddleware(GenerationGate):
    def __init__(self, app: ASGIApp, limits: InFlightLimits) -> None:
        super().__init__(app)
        self.limits = limits

    def admit(self, scope: Scope) -> tuple[Scope, Callable[[], None]] | Response:
        client = client_address(scope)
        try:
            slot = self.limits.enter(client)
        except LimitExceeded as exc:
            return error_response(429, exc.message, type="rate_limit_error", code="rate_limit_exceeded",
                                  headers={"Retry-After": str(exc.retry_after_s)})  # fmt: skip
        if client:
            scope = {**scope, "headers": forwarded_for(scope["headers"], client)}
        return scope, slot.release


def forwarded_for(headers: list[tuple[bytes, bytes]], client: str) -> list[tuple[bytes, bytes]]:
    """`headers` with `client` appended to X-Forwarded-For (the header made when there is none)."""
    earlier = [value for name, value in headers if name.lower() == FORWARDED_FOR]
    chain = b", ".join([*earlier, client.encode()])
    return [(name, value) for name, value in headers if name.lower() != FORWARDED_FOR] + [(FORWARDED_FOR, chain)]
