"""The API-key check: `Authorization: Bearer KEY` on protected paths, else a 401 in OpenAI's shape.

Both HTTP fronts install it as ASGI middleware (the server on /v1/, the router on /v1/ and
/admin/), so it runs before routing and before the body is read. The comparison is constant-time.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from servelm.openai_api.errors import INVALID_REQUEST, error_response

MISSING_KEY_MESSAGE = "Incorrect or missing API key: send it as `Authorization: Bearer <key>`."


class ApiKeyMiddleware:
    """Rejects HTTP requests under `protected_prefixes` that lack the key; no key: lets everything through.

    Stateless after construction: safe for concurrent requests.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, protected_prefixes: Sequence[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.protected_prefixes = tuple(protected_prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.expected is not None and scope["path"].startswith(self.protected_prefixes):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                rejection = error_response(401, MISSING_KEY_MESSAGE, type=INVALID_REQUEST, code="invalid_api_key")
                await rejection(scope, receive, send)
                return
        await self.app(scope, receive, send)
