"""The API-key check: `Authorization: Bearer KEY` on every path but a few open ones, else a 401
in OpenAI's shape.

Both HTTP fronts install it as ASGI middleware (the server and the router), so it runs before
routing and before the body is read. Open paths are an explicit allow-list (health checks, and
metrics where the front chooses so): a route added later is protected by default, and an
unknown path without the key gets 401, not a hint of what exists. The comparison is constant-time.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from servelm.openai_api.errors import INVALID_REQUEST, error_response

MISSING_KEY_MESSAGE = "Incorrect or missing API key: send it as `Authorization: Bearer <key>`."


class ApiKeyMiddleware:
    """Rejects HTTP requests outside `open_paths` that lack the key; no key: lets everything through.

    Stateless after construction: safe for concurrent requests.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: Collection[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.expected is not None and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                rejection = error_response(401, MISSING_KEY_MESSAGE, type=INVALID_REQUEST, code="invalid_api_key")
                await rejection(scope, receive, send)
                return
        await self.app(scope, receive, send)
