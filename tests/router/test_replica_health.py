"""A replica's last_error describes its current outage only: once a health check passes, it is gone."""

from __future__ import annotations

import asyncio
import json
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


class _Starting(BaseHTTPRequestHandler):
    """A servelm replica while its engine starts: alive (/health 200), not serving (/ready 503)
    until the server's `ready` flag is set."""

    def do_GET(self) -> None:
        ready: bool = self.server.ready  # type: ignore[attr-defined]
        if self.path == "/ready" and not ready:
            status, body = 503, json.dumps({"error": {"message": "starting: load", "code": "service_unavailable"}})
        else:
            status, body = (200, "{}") if self.path in ("/health", "/ready") else (404, "")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


def test_an_alive_replica_gets_no_traffic_until_it_is_ready() -> None:
    """(The replicas above answer /ready 404, as vLLM does: their /health decides.)"""
    server = HTTPServer(("127.0.0.1", 0), _Starting)
    server.ready = False  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    router = Router(RouterOptions(policy="round_robin"))
    replica = router.add_replica(ReplicaSpec.parse(f"http://127.0.0.1:{server.server_address[1]}"))

    async def check() -> None:
        async with httpx.AsyncClient() as client:
            await check_replica(client, router, replica, timeout_s=2)

    try:
        asyncio.run(check())
        assert not replica.healthy and router.replicas.healthy() == []
        assert "/ready returned 503 (starting: load)" in replica.last_error
        server.ready = True  # type: ignore[attr-defined]
        asyncio.run(check())
        assert replica.healthy and replica.last_error == ""
    finally:
        server.shutdown()
        server.server_close()
        asyncio.run(router.close())
