"""A replica's last_error describes its current outage only: once a health check passes, it is gone."""

from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx

from servelm.router.app import _replica_summary
from servelm.router.health import check_replica
from servelm.router.replicas import ReplicaSpec
from servelm.router.state import Router, RouterOptions


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_last_error_clears_when_the_replica_is_healthy_again() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens here yet: the start-up check fails

    async def scenario() -> None:
        router = Router(RouterOptions(policy="round_robin"))
        replica = router.add_replica(ReplicaSpec.parse(f"http://127.0.0.1:{port}"))
        async with httpx.AsyncClient() as client:
            await check_replica(client, router, replica, timeout_s=2)
            assert not replica.healthy and "health check failed" in replica.last_error
            server = HTTPServer(("127.0.0.1", port), _Healthy)
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            try:
                await check_replica(client, router, replica, timeout_s=2)
            finally:
                server.shutdown()
                server.server_close()
        assert replica.healthy and replica.last_error == ""
        [summary] = _replica_summary(router)
        assert summary["healthy"] is True and summary["last_error"] == ""
        await router.close()

    asyncio.run(scenario())
