"""Periodic health checks: GET /ready on every replica, every `interval_s`.

A replica that answers 200 within `timeout_s` is (put back) in rotation; one that does not
is taken out at once (Router.mark_down drops its index). /ready: a servelm replica is alive
(/live 200) well before it serves (its engine starting: /ready and /health 503), and must get no
traffic until then. An OpenAI server without /ready (vLLM) answers it 404: its /health decides. The proxy also marks a replica
down the moment a request to it fails at the connection level, without waiting for this.
Before a replica enters rotation its disaggregation role is asked for (roles.py); a replica
whose role cannot be learned stays out, since it might be a prefill-only one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx

from servelm.router.adapters import fetch_adapters
from servelm.router.background import BackgroundTask
from servelm.router.replicas import Replica
from servelm.router.roles import apply_role, fetch_role
from servelm.router.state import Router

READY_PATH = "/ready"  # servelm: serving (the engine ready, not draining)
HEALTH_PATH = "/health"  # any OpenAI server's health; the fallback where /ready is not found


def _reason(response: httpx.Response) -> str:
    """The OpenAI-shaped error's message ("starting: load"), when the body has one."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return f" ({message})" if isinstance(message, str) else ""


async def check_replica(
    client: httpx.AsyncClient, router: Router, replica: Replica, timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> None:  # fmt: skip
    """`headers` go with the role query only (the replicas' API key; /ready and /health are open)."""
    try:
        path = READY_PATH
        response = await client.get(f"{replica.url}{path}", timeout=timeout_s)
        if response.status_code == 404:
            path = HEALTH_PATH
            response = await client.get(f"{replica.url}{path}", timeout=timeout_s)
    except httpx.HTTPError as error:
        await router.mark_down(replica, f"health check failed: {type(error).__name__}: {error}")
        return
    if response.status_code != 200:
        await router.mark_down(replica, f"health check: {path} returned {response.status_code}{_reason(response)}")
        return
    if not replica.healthy:
        try:
            role = await fetch_role(client, replica.url, timeout_s, headers)
        except (httpx.HTTPError, ValueError) as error:
            await router.mark_down(replica, f"role query failed: {type(error).__name__}: {error}")
            return
        apply_role(replica, role, router.options.block_size)
    # Every pass: adapters come and go at run time. Not known (no list) leaves what was known.
    adapters = await fetch_adapters(client, replica.url, timeout_s, headers)
    if adapters is not None:
        replica.adapters = adapters
    router.mark_up(replica)


async def check_all(client: httpx.AsyncClient, router: Router, headers: Mapping[str, str] | None = None) -> None:
    timeout_s = router.options.health_timeout_s
    await asyncio.gather(*(check_replica(client, router, r, timeout_s, headers) for r in router.replicas.all()))


class HealthChecker:
    def __init__(self, router: Router, client: httpx.AsyncClient, headers: Mapping[str, str] | None = None) -> None:
        self.router = router
        self.client = client
        self.headers = dict(headers or {})
        self._task = BackgroundTask("router-health", self._run)

    async def check_all(self) -> None:
        """One pass over every replica now (start-up, a replica added by the admin API)."""
        await check_all(self.client, self.router, self.headers)

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.router.options.health_interval_s)
