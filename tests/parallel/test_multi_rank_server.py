"""A real `servelm serve -tp 2` (and `-cp 2`) over HTTP: it serves the one-rank server's greedy
output; a rank killed mid-stream ends that stream with an error (no hang), fails what is in flight, and turns
/health to 503; nothing of the worker outlives the server."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil
import pytest

from servelm.server.launcher import launch_server

ARGS = ["--num-blocks", "64", "--block-size", "8", "--threads-per-rank", "1", "--distributed-timeout-s", "20"]


def rank_followers(server_pid: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(server_pid).children(recursive=True)
        if "servelm.worker.rank_main" in " ".join(p.cmdline())
    ]


def complete(base_url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def one_rank_text(tiny_dir) -> str:
    """The one-rank server's greedy text for PROMPT: the reference every layout must serve."""
    with launch_server(tiny_dir, ARGS) as single:
        return complete(single.base_url, PROMPT, 16)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor-parallel-size", "2"], ["--context-parallel-size", "2"]], ids=["tp2", "cp2"])
def test_a_two_rank_server_serves_the_one_rank_output_and_a_dead_rank_makes_it_unhealthy(tiny_dir, one_rank_text, layout):
    prompt = PROMPT
    server = launch_server(tiny_dir, [*ARGS, *layout])
    try:
        [follower] = rank_followers(server.process.pid)
        assert complete(server.base_url, prompt, 16) == one_rank_text
        body = {"prompt": prompt, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "stream": True}
        started = time.monotonic()
        chunks, error = 0, None
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    error = event["error"]
                    break
                chunks += 1
                if chunks == 3:
                    os.kill(follower.pid, signal.SIGKILL)
        assert error is not None, "the stream must end with an error, not finish or hang"
        assert time.monotonic() - started < 40
        assert chunks < 400
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503
        refused = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["message"]
    finally:
        server.stop()


@pytest.mark.slow
def test_followers_leave_when_the_engine_core_dies(tiny_dir):
    server = launch_server(tiny_dir, [*ARGS, "--tensor-parallel-size", "2"])
    try:
        [follower] = rank_followers(server.process.pid)
        core = follower.parent()
        assert core is not None and core.pid != server.process.pid
        core.kill()
        follower.wait(timeout=15)  # it watches rank 0's pid: gone within a poll interval or two
        deadline = time.monotonic() + 15
        while httpx.get(f"{server.base_url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "the API must notice its engine core died"
            time.sleep(0.2)
    finally:
        server.stop()
