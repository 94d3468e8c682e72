"""The API-key check: `Authorization: Bearer KEY` on every path but a few open ones, else a 401
in OpenAI's shape.

Both HTTP fronts install it as ASGI middleware (the server and the router), so it runs before
routing and before the body is read. Open paths are an explicit allow-list (health checks, and
metrics where the front chooses so): a route added later is protected by default, and an
unknown path without the key gets 401, not a hint of what exists. Who the key names (the
server: a tenant, servelm.tenancy; the router: just "the key holder") is the `authenticate`
callable's business; it must compare in constant time. What it returns rides on in the ASGI
scope's state as `CALLER_STATE` for the handlers.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from servelm.openai_api.errors import INVALID_REQUEST, error_response

MISSING_KEY_MESSAGE = "Incorrect or missing API key: send it as `Authorization: Bearer <key>`."
CALLER_STATE = "servelm_caller"  # scope["state"] key of what `authenticate` returned

# The `Authorization` header's value (b"" when absent) → who is calling, or None: 401.
Authenticate = Callable[[bytes], object | None]


def single_key(api_key: str | None) -> Authenticate:
    """One key (the caller is `True`), or with None every caller is let through."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    def authenticate(authorization: bytes) -> object | None:
        return True if expected is None or hmac.compare_digest(authorization, expected) else None

    return authenticate


class ApiKeyMiddleware:
    """Rejects HTTP requests outside `open_paths` that `authenticate` refuses.

    Stateless after construction: safe for concurrent requests.
    """

    def __init__(self, app: ASGIApp, authenticate: Authenticate, open_paths: Collection[str]) -> None:
        self.app = app
        self.authenticate = authenticate
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            if CALLER_STATE in scope.get("state", {}):
                # Sent in process by a batch (servelm.batch.executor), its caller already known;
                # only this process writes a scope's state, never an HTTP client.
                await self.app(scope, receive, send)
                return
            caller = self.authenticate(dict(scope["headers"]).get(b"authorization", b""))
            if caller is None:
                rejection = error_response(401, MISSING_KEY_MESSAGE, type=INVALID_REQUEST, code="invalid_api_key")
                await rejection(scope, receive, send)
                return
            scope.setdefault("state", {})[CALLER_STATE] = caller
        await self.app(scope, receive, send)
