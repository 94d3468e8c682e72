"""API keys (401), the bounded waiting queue (429 + Retry-After), and SIGTERM draining, each on
a server started with the flags under test."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time

import httpx

from helpers_http import KEY, child_pids, wait_idle
from servelm.server.app import ServerOptions
from servelm.server.launcher import launch_server


def test_api_key_from_flag_or_environment(monkeypatch):
    monkeypatch.setenv("SERVELM_API_KEY", "from-env")
    assert ServerOptions.from_args(argparse.Namespace(api_key=None, port=1)).api_key == "from-env"
    assert ServerOptions.from_args(argparse.Namespace(api_key="from-flag")).api_key == "from-flag"
    monkeypatch.delenv("SERVELM_API_KEY")
    assert ServerOptions.from_args(argparse.Namespace(api_key=None)).api_key is None


def test_api_key_required_on_v1_only(restricted):
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(f"{restricted.base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{restricted.base_url}/v1/models", timeout=10).status_code == 401
    ok = httpx.post(
        f"{restricted.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    # Health checks and scrapes stay open, as load balancers and Prometheus expect.
    assert httpx.get(f"{restricted.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{restricted.base_url}/metrics", timeout=10).status_code == 200


def test_overload_gets_429_with_retry_after_never_a_pile_up(restricted):
    body = {"prompt": "Tell me a long story", "max_tokens": 32, "ignore_eos": True, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(
            base_url=restricted.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
        ) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(16)))

    started = time.monotonic()
    responses = asyncio.run(main())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
    for response in responses:
        if response.status_code == 429:
            assert response.headers["Retry-After"] == "1"
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
            assert "limit 3" in error["message"]
        else:
            assert response.json()["usage"]["completion_tokens"] == 32
    assert time.monotonic() - started < 60
    wait_idle(restricted)


def test_sigterm_drains_in_flight_requests_then_exits_cleanly(tiny_model_dir):
    args = ["--num-blocks", "512", "--num-threads", "1", "--shutdown-timeout", "3", "--log-requests"]
    server = launch_server(tiny_model_dir, args)
    try:
        result = asyncio.run(_drain_scenario(server))
        code = server.process.wait(timeout=30)
    finally:
        server.stop()
    short_tokens, long_outcome, refused, exit_s = result
    assert short_tokens == 24, "a request in flight at SIGTERM runs to completion"
    assert refused, "no new connections are accepted after SIGTERM"
    assert code == 0, server.log_tail()
    # A request longer than the deadline is cut at the deadline; the exit follows promptly.
    assert long_outcome in ("complete", "cut") and exit_s < 3 + 10
    # --log-requests: one JSON line per request, carrying its timeline.
    records = [json.loads(line) for line in server.log_tail(200_000).splitlines() if line.startswith('{"model"')]
    short_record = next(r for r in records if r["completion_tokens"] == 24)
    assert short_record["finish_reasons"] == ["length"]
    assert short_record["timeline"]["ttft_breakdown_ms"]["ttft"] > 0
    assert [e["type"] for e in short_record["timeline"]["choices"][0]["events"]][:3] == ["arrived", "queued", "scheduled"]


def test_engine_death_fails_requests_fast_and_health_says_so(tiny_model_dir):
    # No restarts: the first death is final (test_engine_supervision.py has the restarts).
    server = launch_server(tiny_model_dir, ["--num-blocks", "512", "--num-threads", "1", "--max-engine-restarts", "0"])
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            body = {"prompt": "Doomed", "max_tokens": 900, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                [core_pid] = child_pids(server.process.pid, "spawn_main")  # not the resource tracker
                os.kill(core_pid, signal.SIGKILL)
                rest = list(lines)  # must end, not hang
            events = [line for line in rest if line.startswith("data: ")]
            assert '"server_error"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
            late = client.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["code"] == "service_unavailable"
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["message"].startswith("engine crashed once")
    finally:
        server.stop()


async def _drain_scenario(server) -> tuple[int, str, bool, float]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        short_started, long_started = asyncio.Event(), asyncio.Event()
        short = asyncio.create_task(_stream_tokens(client, 24, short_started))
        long = asyncio.create_task(_stream_tokens(client, 1000, long_started))
        await asyncio.wait_for(asyncio.gather(short_started.wait(), long_started.wait()), 60)
        sent = time.monotonic()
        server.terminate()
        await asyncio.sleep(0.5)
        try:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as fresh:
                await fresh.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            refused = False
        except httpx.TransportError:
            refused = True
        short_tokens = await short
        try:
            long_outcome = "complete" if await long == 1000 else "cut"
        except httpx.TransportError:
            long_outcome = "cut"
        await asyncio.get_running_loop().run_in_executor(None, server.process.wait, 30)
        return short_tokens, long_outcome, refused, time.monotonic() - sent


async def _stream_tokens(client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> int:
    """Stream a completion; return its usage's completion tokens (0 if the stream ended without usage)."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                started.set()
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens
