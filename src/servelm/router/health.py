"""Periodic health checks: GET /health on every replica, every `interval_s`.

A replica that answers 200 within `timeout_s` is (put back) in rotation; one that does not
is taken out at once (Router.mark_down drops its index). The proxy also marks a replica
down the moment a request to it fails at the connection level, without waiting for this.
"""

from __future__ import annotations

import asyncio

import httpx

from servelm.router.background import BackgroundTask
from servelm.router.replicas import Replica
from servelm.router.state import Router


async def check_replica(client: httpx.AsyncClient, router: Router, replica: Replica, timeout_s: float) -> None:
    try:
        response = await client.get(f"{replica.url}/health", timeout=timeout_s)
    except httpx.HTTPError as error:
        await router.mark_down(replica, f"health check failed: {type(error).__name__}: {error}")
        return
    if response.status_code == 200:
        router.mark_up(replica)
    else:
        await router.mark_down(replica, f"health check returned {response.status_code}")


async def check_all(client: httpx.AsyncClient, router: Router) -> None:
    timeout_s = router.options.health_timeout_s
    await asyncio.gather(*(check_replica(client, router, r, timeout_s) for r in router.replicas.all()))


class HealthChecker:
    def __init__(self, router: Router, client: httpx.AsyncClient) -> None:
        self.router = router
        self.client = client
        self._task = BackgroundTask("router-health", self._run)

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        while True:
            await check_all(self.client, self.router)
            await asyncio.sleep(self.router.options.health_interval_s)
