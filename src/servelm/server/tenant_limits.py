"""Limits around the generation routes (tenancy/limits.py): a request holds its slots (in the
process's, its client address's and its tenant's count of requests in flight) for as long as its
ASGI call runs, so they free on every path: the whole response sent (a stream's last event
included), a client that left (the call is cancelled), an error, a shutdown abort, a cut stream.

    ApiKeyMiddleware (the tenant) ─▶ TenantLimitsMiddleware ─enter─▶ routes ─▶ handler: lease.reserve(tokens)
                                          └──────────── release (finally) ◀────────┘

The handler finds the lease in the scope's state (`LEASE_STATE`) to reserve the request's tokens
once its prompt is tokenized (serving.reserve_tokens).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Scope

from servelm.openai_api.auth import CALLER_STATE
from servelm.openai_api.overload import GenerationGate, client_address
from servelm.server.errors import tenant_limit_error
from servelm.tenancy.limits import LimitExceeded, TenantLimits

LEASE_STATE = "servelm_lease"


class TenantLimitsMiddleware(GenerationGate):
    def __init__(self, app: ASGIApp, limits: TenantLimits) -> None:
        super().__init__(app)
        self.limits = limits

    def admit(self, scope: Scope) -> tuple[Scope, Callable[[], None]] | Response:
        state = scope.setdefault("state", {})
        try:
            lease = self.limits.enter(state[CALLER_STATE], client_address(scope))
        except LimitExceeded as exc:
            return tenant_limit_error(exc).response()
        state[LEASE_STATE] = lease
        return scope, lease.release
