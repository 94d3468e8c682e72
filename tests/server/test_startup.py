"""Cold start you can see (issue 16), on real `servelm serve` processes:

- the server listens while its engine starts: /live 200, /health and /ready 503 "starting: <phase>", every
  engine route 503 with Retry-After, /metrics 200; then /ready 200, requests are served, and
  /metrics has servelm:startup_seconds for each phase the engine ran;
- a start-up that fails after the server listens ends the process non-zero, the error logged;
- SIGTERM while the engine starts: a clean exit at once, the engine core process gone with it.

A slow start is made real with SERVELM_FAULT_STARTUP_DELAY_S (the builder sleeps in its load phase).
"""

from __future__ import annotations

import os
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from helpers_http import child_pids
from servelm.engine.builder import FAULT_STARTUP_DELAY_ENV
from servelm.server.launcher import launch_server

ARGS = ["--num-blocks", "128", "--num-threads", "1"]
DELAY_S = 3.0
# What a server that is not ready yet must refuse, with the bodies it would otherwise accept.
ENGINE_ROUTES = [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]


def _startup_seconds(metrics_text: str) -> dict[str, float]:
    families = {family.name: family for family in text_string_to_metric_families(metrics_text)}
    return {sample.labels["phase"]: sample.value for sample in families["servelm:startup_seconds"].samples}


def _wait_ready(client: httpx.Client, timeout_s: float) -> list[str]:
    """Poll /ready until 200; the distinct 503 messages seen on the way, in order."""
    messages: list[str] = []
    deadline = time.monotonic() + timeout_s
    while (response := client.get("/ready")).status_code != 200:
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        if not messages or messages[-1] != message:
            messages.append(message)
        assert client.get("/live").status_code == 200, "alive all the while it starts"
        health = client.get("/health")  # a moment later: start-up may have moved to its next phase
        if health.status_code != 200:
            assert health.status_code == 503 and health.json()["error"]["message"].startswith("starting: "), \
                "not ready, as /ready"  # fmt: skip
        assert time.monotonic() < deadline, f"not ready after {timeout_s} s: {messages}"
        time.sleep(0.1)
    return messages


def test_the_server_listens_while_its_engine_starts_then_shows_where_the_time_went(tiny_model_dir):
    env = {FAULT_STARTUP_DELAY_ENV: str(DELAY_S)}
    with launch_server(tiny_model_dir, ARGS, env=env, wait_for="/live") as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            ready = client.get("/ready")
            assert ready.status_code == 503 and ready.json()["error"]["message"].startswith("starting: "), ready.text
            assert client.get("/live").json() == {"status": "starting"}
            health = client.get("/health")  # a script waiting for /health never sends too early
            assert health.status_code == 503 and health.json()["error"]["message"].startswith("starting: ")
            for method, path, body in ENGINE_ROUTES:
                refused = client.request(method, path, json=body)
                assert refused.status_code == 503, (path, refused.text)
                assert refused.json()["error"]["code"] == "service_unavailable" and "retry-after" in refused.headers
            starting_metrics = client.get("/metrics")
            assert starting_metrics.status_code == 200 and _startup_seconds(starting_metrics.text) == {}

            messages = _wait_ready(client, timeout_s=120)
            assert "starting: load" in messages, messages
            assert client.get("/health").json() == {"status": "ok"} == client.get("/live").json()
            completion = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert completion.status_code == 200, completion.text
            seconds = _startup_seconds(client.get("/metrics").text)
    assert server.process.returncode == 0, server.log_tail()
    assert set(seconds) == {"kernel_build", "load", "kv_sizing", "warmup"}
    assert seconds["load"] >= DELAY_S and all(value >= 0 for value in seconds.values()), seconds
    log = server.log_tail(50_000)
    for phase in seconds:
        assert f"start-up phase {phase}" in log, log


def test_a_start_up_that_fails_after_the_server_listens_exits_non_zero_with_the_error_logged(tmp_path):
    missing = tmp_path / "no-such-model"
    env = {FAULT_STARTUP_DELAY_ENV: "1"}  # long enough to see it listening, then the load fails
    server = launch_server(missing, ARGS, env=env, wait_for="/live")
    try:
        assert httpx.get(f"{server.base_url}/live", timeout=10).status_code == 200
        code = server.process.wait(timeout=120)
    finally:
        server.stop()
    assert code != 0
    log = server.log_tail(50_000)
    assert "engine start-up failed during load" in log and f"model path {missing} does not exist" in log, log


def test_sigterm_while_the_engine_starts_exits_cleanly_and_takes_the_core_with_it(tiny_model_dir):
    server = launch_server(tiny_model_dir, ARGS, env={FAULT_STARTUP_DELAY_ENV: "60"}, wait_for="/live")
    try:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            deadline = time.monotonic() + 60
            while client.get("/ready").json()["error"]["message"] != "starting: load":  # the core is in its sleep
                assert time.monotonic() < deadline
                time.sleep(0.1)
        [core_pid] = child_pids(server.process.pid, "spawn_main")
        server.terminate()
        code = server.process.wait(timeout=20)  # not the 60 s the core would sleep on
    finally:
        server.stop()
    assert code == 0, server.log_tail()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{core_pid}") and _state(core_pid) != "Z":
        assert time.monotonic() < deadline, "the engine core outlived its server"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"  # gone meanwhile
