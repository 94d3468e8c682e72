"""What an outside probe tried (issue 20), over real HTTP: every hostile request gets a 4xx in
OpenAI's shape naming the field, never a 5xx or a 2xx, the connection stays usable, the server
stays healthy; which routes answer without the API key; backpressure that says 400 when waiting
cannot help and admits a burst that fits."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from helpers_http import KEY, wait_idle
from servelm.bench.hostile import hostile_cases, run_hostile
from servelm.config import EngineConfig
from servelm.server.app import ServerOptions, create_app, open_paths
from servelm.server.errors import install_error_handlers
from servelm.server.launcher import launch_server


def test_every_hostile_request_gets_a_4xx_naming_the_field(server):
    cases = hostile_cases()
    report = run_hostile(server.base_url, cases)
    wrong = [(r.case.name, r.status, r.detail[:200]) for r in report.results if r.outcome != "4xx"]
    assert not wrong, wrong
    for result in report.results:
        assert result.error is not None and set(result.error) == {"message", "type", "param", "code"}, result.case.name
        assert result.error["type"] == "invalid_request_error", (result.case.name, result.error)
        assert result.names_param, (result.case.name, result.error)
    assert report.broken_connections == 0, [(r.case.name, r.detail) for r in report.results if not r.follow_up_ok]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    wait_idle(server)


def test_error_messages_say_what_was_wrong(server):
    report = run_hostile(server.base_url, [c for c in hostile_cases() if c.name in {
        "/v1/completions seed=2^100", "/v1/completions temperature=+inf", "/v1/completions content-type=text/plain",
        "/v1/completions oversize body", "/v1/completions user=lone-surrogate",
        "/v1/chat/completions user message without content"}])  # fmt: skip
    said = {r.case.name: (r.status, r.error["message"]) for r in report.results if r.error}
    assert said["/v1/completions seed=2^100"][0] == 400 and "less than or equal" in said["/v1/completions seed=2^100"][1]
    assert "finite" in said["/v1/completions temperature=+inf"][1]
    assert said["/v1/completions content-type=text/plain"][0] == 415
    assert said["/v1/completions oversize body"][0] == 413
    assert "surrogate" in said["/v1/completions user=lone-surrogate"][1]
    assert "must have content" in said["/v1/chat/completions user message without content"][1]


def test_a_500_keeps_the_connection_usable_and_says_nothing_internal():
    """A handler bug (the only way left to a 500): generic message, and the next request on the
    same keep-alive connection is answered."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("secret detail /etc/servelm/token")

    @app.get("/fine")
    async def fine() -> dict:
        return {"ok": True}

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/boom")
        response = connection.getresponse()
        body = response.read().decode()
        assert response.status == 500 and "secret" not in body and "RuntimeError" not in body, body
        assert "error id" in body and response.getheader("connection", "") != "close"
        sock = connection.sock
        connection.request("GET", "/fine")
        follow = connection.getresponse()
        assert follow.status == 200 and follow.read() == b'{"ok":true}'
        assert connection.sock is sock, "the same connection served the next request"
        connection.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# Every route the server registers, and whether it answers without the key (with one set).
ROUTES = {
    ("POST", "/v1/completions"): False,
    ("POST", "/v1/chat/completions"): False,
    ("GET", "/v1/models"): False,
    ("GET", "/v1/models/{model_id:path}"): False,
    ("GET", "/v1/kv_transfer"): False,  # the router asks it with its key (disaggregation roles)
    ("POST", "/tokenize"): False,
    ("POST", "/detokenize"): False,
    ("GET", "/openapi.json"): False,
    ("GET", "/servelm/model/{path:path}"): False,  # the weights a new replica pulls (peer://): never public
    ("GET", "/live"): True,
    ("GET", "/health"): True,
    ("GET", "/ready"): True,  # a readiness probe, like /health
    ("GET", "/metrics"): True,  # open unless --protect-metrics, as vLLM and Prometheus expect
    ("POST", "/v1/load_lora_adapter"): False,  # LoRA at run time: reads a path on the server
    ("POST", "/v1/unload_lora_adapter"): False,
    # Batch jobs (servelm.batch.routes): a tenant's files and batches.
    ("POST", "/v1/files"): False,
    ("GET", "/v1/files"): False,
    ("GET", "/v1/files/{file_id}"): False,
    ("DELETE", "/v1/files/{file_id}"): False,
    ("GET", "/v1/files/{file_id}/content"): False,
    ("POST", "/v1/batches"): False,
    ("GET", "/v1/batches"): False,
    ("GET", "/v1/batches/{batch_id}"): False,
    ("POST", "/v1/batches/{batch_id}/cancel"): False,
}


# Past the key: this server has no --kv-role, nor --allow-runtime-lora-updating.
# The batch routes past the key: a JSON body is no upload (400), {} no batch (400), unknown ids 404.
KEYED_STATUS = {"/v1/kv_transfer": 404, "/v1/load_lora_adapter": 404, "/v1/unload_lora_adapter": 404,
                "/v1/files": 200, "/v1/files/{file_id}": 404, "/v1/files/{file_id}/content": 404, "/v1/batches": 200,
                "/v1/batches/{batch_id}": 404, "/v1/batches/{batch_id}/cancel": 404}  # fmt: skip
KEYED_POST_STATUS = {"/v1/files": 400, "/v1/batches": 400}  # the same paths' POSTs
REQUESTED = {"/servelm/model/{path:path}": "/servelm/model/servelm-manifest.json",
             "/v1/models/{model_id:path}": "/v1/models/model", "/v1/files/{file_id}": "/v1/files/file-nope",
             "/v1/files/{file_id}/content": "/v1/files/file-nope/content",
             "/v1/batches/{batch_id}": "/v1/batches/batch_nope",
             "/v1/batches/{batch_id}/cancel": "/v1/batches/batch_nope/cancel"}  # fmt: skip  # a route's concrete path


def test_every_route_but_the_probes_and_metrics_needs_the_key(restricted):
    app = create_app(EngineConfig.from_flat(), ServerOptions(api_key=KEY))
    registered = {(method, route.path) for route in app.routes for method in getattr(route, "methods", ()) if method != "HEAD"}
    assert registered == set(ROUTES), "a route was added or removed: decide whether it needs the key, here"
    bodies = {"/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/tokenize": {"prompt": "hi"},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              "/detokenize": {"tokens": [1, 2]}, "/v1/files": {}, "/v1/batches": {}}  # fmt: skip
    with httpx.Client(base_url=restricted.base_url, timeout=30) as client:
        for (method, path), is_open in ROUTES.items():
            anonymous = client.request(method, REQUESTED.get(path, path), json=bodies.get(path))
            if is_open:
                assert anonymous.status_code == 200, (path, anonymous.text)
            else:
                assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key", path
                keyed = client.request(method, REQUESTED.get(path, path), json=bodies.get(path),
                                       headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
                expected = KEYED_POST_STATUS.get(path) if method == "POST" and path in KEYED_POST_STATUS else None
                assert keyed.status_code == (expected or KEYED_STATUS.get(path, 200)), (method, path, keyed.text)
        assert client.get("/no/such/route").status_code == 401, "unknown paths reveal nothing without the key"
    assert open_paths(ServerOptions(api_key=KEY, protect_metrics=True)) == {"/live", "/health", "/ready"}


def test_a_request_larger_than_the_queue_is_a_400_not_a_429(restricted):
    """--max-waiting-requests 3: n=5 can never be admitted, so retrying is pointless."""
    headers = {"Authorization": f"Bearer {KEY}"}
    for body in ({"prompt": "hi", "max_tokens": 2, "n": 5}, {"prompt": ["a", "b"], "max_tokens": 2, "n": 2}):
        response = httpx.post(f"{restricted.base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 400 and "Retry-After" not in response.headers, response.text
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and "at most 3" in error["message"]
    ok = httpx.post(f"{restricted.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3},
                    headers=headers, timeout=30)  # fmt: skip
    assert ok.status_code == 200, ok.text


@pytest.mark.serial  # how many wait at once depends on how fast the core admits: the machine to itself
def test_a_burst_below_capacity_is_admitted(tiny_model_dir):
    """A small waiting limit, many free sequence slots: a burst that can run at once all runs."""
    args = ["--num-blocks", "1024", "--max-num-seqs", "64", "--max-waiting-requests", "4", "--num-threads", "1"]
    server = launch_server(tiny_model_dir, args)
    try:
        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
                body = {"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}
                responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(40)))
            return [r.status_code for r in responses]

        statuses = asyncio.run(burst())
        assert statuses == [200] * 40, statuses
        wait_idle(server)
    finally:
        assert server.stop() == 0, server.log_tail()


@pytest.mark.parametrize("path, body", [("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}'),
                                        ("/tokenize", b'{"prompt": "hi"}')])  # fmt: skip
def test_json_with_charset_is_json(server, path, body):
    response = httpx.post(f"{server.base_url}{path}", content=body,
                          headers={"Content-Type": "application/json; charset=utf-8"}, timeout=30)  # fmt: skip
    assert response.status_code == 200, response.text
