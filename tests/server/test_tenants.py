"""Tenants over real HTTPS: one `servelm serve --tenants FILE --api-key K --ssl-*` on the tiny
model. Keys name tenants (anything else is 401), each tenant's limits answer 429 with
Retry-After while other tenants go on, a slot frees when its client leaves, the client's
priority is clamped into the tenant's range before it reaches the engine, and metrics carry
tenant and SLO class labels."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from helpers_http import metric_value
from servelm.server.launcher import ServerProcess, launch_server
from servelm.testing.delivery_cluster import wait_until

TENANTS = """
tenants:
  voice: {api_keys: [voice-key], class: realtime, max_concurrent_requests: 1}
  code: {api_keys: [code-key], class: interactive, tokens_per_minute: 240}
  reports: {api_keys: [reports-key], class: batch, priority: {min: 1, max: 3}}
"""
HOLD_TOKENS = 1000  # a stream long enough to still run while the next request arrives (tiny model: 1024 context)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
def tls_server(tiny_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tenants")
    (directory / "tenants.yaml").write_text(TENANTS)
    key, cert = _self_signed(directory)
    args = ["--tenants", str(directory / "tenants.yaml"), "--api-key", "default-key", "--log-requests",
            "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
            "--num-blocks", "512", "--max-num-seqs", "8", "--num-threads", "1"]  # fmt: skip
    trust = ssl.create_default_context(cafile=str(cert))  # the test's own certificate is the one CA trusted
    process = launch_server(tiny_model_dir, args, verify=trust)
    process.trust = trust  # type: ignore[attr-defined]
    yield process
    assert process.stop() == 0, process.log_tail()


def _client(server: ServerProcess, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, verify=server.trust, timeout=60)  # type: ignore[attr-defined]


def _complete(server: ServerProcess, key: str, **body) -> httpx.Response:
    with _client(server, key) as client:
        return client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4, **body})


def test_https_serves_and_keys_name_tenants(tls_server):
    assert _complete(tls_server, "default-key").status_code == 200
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is no way in
        httpx.get(f"http://127.0.0.1:{tls_server.port}/health", timeout=5)
    for key in ("wrong-key", None):
        with _client(tls_server, key) as client:
            response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert "wrong-key" not in response.text
    with _client(tls_server, None) as client:
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_concurrency_limit_is_per_tenant_and_frees_when_the_client_leaves(tls_server):
    with _client(tls_server, "voice-key") as voice:
        body = {"prompt": "Hold on", "max_tokens": HOLD_TOKENS, "ignore_eos": True, "stream": True}
        with voice.stream("POST", "/v1/completions", json=body) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator closes the connection (the client leaves)
            next(lines)  # the stream runs: voice's one slot is taken
            refused = _complete(tls_server, "voice-key")
            assert _complete(tls_server, "code-key").status_code == 200  # another tenant is untouched
        # The held stream was closed mid-way (the client left): its slot is free again.
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "max_concurrent_requests" in error["message"] and int(refused.headers["Retry-After"]) >= 1
    # The server learns the client left at its next write to it (a token later, under a loaded
    # machine a little more): the slot is free within a couple of seconds, not after a timeout.
    deadline = time.monotonic() + 5.0
    while (status := _complete(tls_server, "voice-key").status_code) == 429 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == 200


def test_tokens_per_minute_limit_answers_429_with_retry_after(tls_server):
    too_large = _complete(tls_server, "code-key", max_tokens=400)
    assert too_large.status_code == 400 and "tokens_per_minute" in too_large.json()["error"]["message"]
    # 240 a minute (4 per second): two of these (prompt + 100) cannot both fit in the bucket.
    body = {"max_tokens": 100, "ignore_eos": True}
    responses = [_complete(tls_server, "code-key", **body) for _ in range(3)]
    refused = [r for r in responses if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in responses), [r.text for r in responses]
    assert "tokens_per_minute" in refused[0].json()["error"]["message"]
    assert 1 <= int(refused[0].headers["Retry-After"]) <= 60
    assert _complete(tls_server, "voice-key").status_code == 200  # another tenant is untouched


def test_priority_is_clamped_into_the_tenant_range_and_labels_name_tenant_and_class(tls_server):
    response = _complete(tls_server, "reports-key", priority=9)
    assert response.status_code == 200
    request_id = response.json()["id"]
    logged = [json.loads(line) for line in tls_server.log_path.read_text().splitlines() if request_id in line]
    assert len(logged) == 1
    assert (logged[0]["tenant"], logged[0]["slo_class"], logged[0]["priority"]) == ("reports", "batch", 3)
    with _client(tls_server, None) as client:
        text = client.get("/metrics").text
    labels = 'slo_class="batch",tenant="reports"'
    assert metric_value(text, "servelm:request_success_total", labels) >= 1
    # The batch class promises TTFT 30 s and TBT 1 s: a tiny model's request keeps that.
    assert metric_value(text, "servelm:request_slo_met_total", labels) >= 1
    assert metric_value(text, "servelm:request_success_total", 'slo_class="interactive",tenant="default"') >= 1


def test_a_bad_tenants_file_stops_serve_with_the_file_and_field(tmp_path, tiny_model_dir):
    bad = tmp_path / "tenants.yaml"
    bad.write_text("tenants: {a: {api_keys: [k], class: gold}}")
    marker = uuid.uuid4().hex  # finds any process this serve left behind (its prestarted engine core)
    done = subprocess.run([sys.executable, "-m", "servelm.cli", "serve", "--model", str(tiny_model_dir), "--tenants",
                           str(bad)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SERVELM_TEST_MARKER": marker})  # fmt: skip
    assert done.returncode == 2
    assert f"{bad}: tenants.a.class: 'gold'" in done.stderr
    wait_until(lambda: not _processes_marked(marker), 10, "the prestarted engine core to leave")


def _processes_marked(marker: str) -> list[psutil.Process]:
    marked = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("SERVELM_TEST_MARKER") == marker:
                marked.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return marked
