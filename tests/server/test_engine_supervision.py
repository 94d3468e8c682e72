"""Engine-core supervision with real processes: kill -9 the core under load, the server restarts it
(in-flight requests end with a clear error, new ones are served with the same greedy tokens, KV back
at baseline); a core that keeps failing ends in a stable "not restarting" state."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from helpers_http import child_pids, metric_value, scrape, wait_idle
from servelm.delivery.file_server import DirectoryFiles, RangeFileServer
from servelm.delivery.manifest import write_manifest
from servelm.engine.builder import FAULT_FAIL_START_ENV
from servelm.server.launcher import ServerProcess, launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

ARGS = ["--num-blocks", "512", "--num-threads", "1"]
PROMPTS = ["The engine restarts", "Supervision keeps", "Once upon a time"]


def _core_pid(server: ServerProcess) -> int:
    [pid] = child_pids(server.process.pid, "spawn_main")  # not the resource tracker
    return pid


def _greedy(client: httpx.Client, prompt: str) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


async def _stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[dict]:
    """A long greedy stream; its parsed events (the error event, if any) until [DONE]."""
    body = {"prompt": "A long story", "max_tokens": 900, "ignore_eos": True, "stream": True}
    events: list[dict] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                events.append({"done": True})
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                started.set()
    return events


async def _kill_under_load(server: ServerProcess) -> tuple[list[list[dict]], httpx.Response, list[tuple[int, str]]]:
    """Three streams and one non-streaming request in flight, then kill -9 of the core; /health
    polled until it is 200 again. Returns the streams' events, the non-streaming response and
    the (status, body) of every /health poll."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        started = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(_stream(client, event)) for event in started]
        whole = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": "Not streamed", "max_tokens": 900, "ignore_eos": True}))  # fmt: skip
        deadline = time.monotonic() + 60
        while not all(event.is_set() for event in started):  # every stream has its first tokens
            for task in (*streams, whole):
                if task.done():
                    pytest.fail(f"a request ended before the kill: {task.result()}")
            assert time.monotonic() < deadline, "the streams did not start"
            await asyncio.sleep(0.02)
        os.kill(_core_pid(server), signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)  # each must end, not hang
        response = await asyncio.wait_for(whole, 30)
        polls: list[tuple[int, str]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = await client.get("/health")
            polls.append((health.status_code, health.text))
            if health.status_code == 200:
                break
            if len(polls) == 1:  # while it restarts, a new request is refused at once, not held
                late = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                polls.append((late.status_code, late.headers.get("retry-after", "")))
            await asyncio.sleep(0.2)
        return results, response, polls


def test_a_killed_core_is_restarted_and_a_crash_loop_then_gives_up(tmp_path: Path):
    """One server, two phases (a server start is most of the cost): kill -9 under load, restarted;
    then every start fails (fault injection): the crash budget, which counts the first crash too
    (both fall in the window), runs out after one more attempt. Its model is a remote one whose
    origin is gone once it has been pulled: a restart loads the download directory, no second pull."""
    marker = tmp_path / "fail-start"
    args = [*ARGS, "--max-engine-restarts", "2", "--engine-restart-window-s", "120",
            "--download-dir", str(tmp_path / "downloads")]  # fmt: skip
    origin_dir = write_tiny_checkpoint(tmp_path / "origin" / "tiny", seed=4)
    write_manifest(origin_dir)
    origin = RangeFileServer(DirectoryFiles(origin_dir)).start()
    try:
        server = launch_server(origin.url, args, env={FAULT_FAIL_START_ENV: str(marker)})
    finally:
        origin.stop()
    with server:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            _killed_under_load_then_restarted(server, client)
            marker.touch()  # every start from now on fails
            _crash_loop_gives_up(server, client)
        assert server.process.poll() is None  # given up, the process stays up (the liveness probe decides)
        log = server.log_tail(50_000)
        assert "engine core died (killed by SIGKILL)" in log
        assert f"{FAULT_FAIL_START_ENV}: {marker} exists" in log  # the failed start's traceback, as the core sent it
        assert server.stop() == 0, log


def _killed_under_load_then_restarted(server: ServerProcess, client: httpx.Client) -> None:
    before = [_greedy(client, prompt) for prompt in PROMPTS]
    baseline = metric_value(wait_idle(server), "servelm:kv_cache_used_blocks")
    first_core = _core_pid(server)
    streams, whole, polls = asyncio.run(_kill_under_load(server))
    for events in streams:
        # Some tokens, then the error event naming what happened, then [DONE].
        assert any(e.get("choices") and e["choices"][0]["text"] for e in events[:-2]), events[:3]
        error = events[-2]["error"]
        assert error["code"] == "engine_core_died" and "retry" in error["message"], error
        assert events[-1] == {"done": True}
    assert whole.status_code == 503 and int(whole.headers["retry-after"]) > 0, whole.text
    assert whole.json()["error"]["code"] == "engine_core_died"
    assert "died" in whole.json()["error"]["message"] and "restarted" in whole.json()["error"]["message"]
    assert polls[0][0] == 503 and "engine restarting (attempt 1 of 2)" in polls[0][1], polls[:3]
    late_status, late_retry_after = polls[1]
    assert late_status == 503 and int(late_retry_after) > 0
    assert polls[-1][0] == 200, polls[-3:]
    assert client.get("/ready").status_code == 200
    assert _core_pid(server) != first_core
    # The replacement core computes exactly what the first did, from an empty pool.
    assert [_greedy(client, prompt) for prompt in PROMPTS] == before
    text = wait_idle(server)
    assert metric_value(text, "servelm:kv_cache_used_blocks") == baseline == 0
    assert metric_value(text, "servelm:engine_restarts_total") == 1


def _crash_loop_gives_up(server: ServerProcess, client: httpx.Client) -> None:
    os.kill(_core_pid(server), signal.SIGKILL)
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "not restarting" not in (seen or [""])[-1]:
        health = client.get("/health")  # 200 until the kill is noticed (~0.2 s)
        seen.append(health.json()["error"]["message"] if health.status_code == 503 else health.text)
        if health.status_code == 503 and "not restarting" not in seen[-1]:
            live = client.get("/live")  # alive while it restarts: no pod restart meanwhile
            # ...unless the supervisor gave up between the two requests (a failing start is quick).
            gave_up_since = live.status_code == 503 and live.json()["error"]["message"].endswith("; not restarting")
            assert gave_up_since or (live.status_code, live.json()) == (200, {"status": "restarting"}), live.text
        time.sleep(0.1)
    assert "engine restarting (attempt 2 of 2)" in seen, sorted(set(seen))
    gave_up = seen[-1]
    assert gave_up.startswith("engine crashed 3 times in ") and gave_up.endswith("; not restarting"), gave_up
    for _ in range(5):  # stable: no flapping back to "restarting", no restart behind it
        time.sleep(0.3)
        health, ready, live = client.get("/health"), client.get("/ready"), client.get("/live")
        assert (health.status_code, health.json()["error"]["message"]) == (503, gave_up)
        assert ready.status_code == 503
        assert (live.status_code, live.json()["error"]["message"]) == (503, gave_up)  # the pod is replaced
    refused = client.post("/v1/completions", json={"prompt": "anyone?", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["message"] == gave_up
    assert int(refused.headers["retry-after"]) > 0
    assert metric_value(scrape(server), "servelm:engine_restarts_total") == 2
    assert child_pids(server.process.pid, "spawn_main") == []  # no core left running

