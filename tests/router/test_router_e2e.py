"""The router in front of 2 real replicas (see conftest.fleet): streaming, kv routing
asserted from the replicas' own prefix-hit counters, admin, and losing a replica mid-run.
The replica-killing test runs last: it leaves the fleet one replica short."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from router_helpers import ROUTER_KEY
from servelm.cluster.local import LocalCluster
from servelm.server.launcher import launch_server

AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}


def router_url(fleet: LocalCluster) -> str:
    return fleet.urls()["router"]


def replica_urls(fleet: LocalCluster) -> list[str]:
    return [p.spec.url for p in fleet.processes if p.spec.role == "replica"]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def metric_with(url: str, name: str, label: str) -> float:
    """The sum of `name`'s samples that carry `label` (e.g. 'finished_reason="abort"')."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and label in line)


def admin(fleet: LocalCluster) -> dict[str, dict]:
    replicas = httpx.get(f"{router_url(fleet)}/admin/replicas", headers=AUTH, timeout=10).json()["replicas"]
    return {r["url"]: r for r in replicas}


def wait_until(condition, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def tenant_prompt(tenant: int, question: int) -> str:
    system = " ".join(f"tenant{tenant} rule {i} says be careful" for i in range(40))  # ~300 tokens
    return f"{system}\nQuestion {question}: what is {question} plus {tenant}?"


def test_api_key_guards_v1_and_admin(fleet: LocalCluster) -> None:
    for method, path in (("GET", "/admin/replicas"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
        assert httpx.request(method, router_url(fleet) + path, timeout=10).status_code == 401
    listed = httpx.get(f"{router_url(fleet)}/v1/models", headers=AUTH, timeout=10)
    assert listed.status_code == 200
    card = listed.json()["data"][0]
    assert httpx.get(f"{router_url(fleet)}/v1/models/{card['id']}", headers=AUTH, timeout=10).json() == card
    assert httpx.get(f"{router_url(fleet)}/v1/models/gpt-7", headers=AUTH, timeout=10).status_code == 404
    assert httpx.get(f"{router_url(fleet)}/health", timeout=10).status_code == 200


def test_streaming_passes_through_chunk_by_chunk(fleet: LocalCluster) -> None:
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 24, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{router_url(fleet)}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-servelm-replica"] in replica_urls(fleet)
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(text_chunks) >= 5  # one SSE event per step, not one buffered blob
    assert chunks[-1]["usage"]["completion_tokens"] == 24


def _complete(fleet: LocalCluster, prompt: str, max_tokens: int = 4) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{router_url(fleet)}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return response


def test_kv_policy_sends_repeated_prefixes_to_the_replica_that_holds_them(fleet: LocalCluster) -> None:
    urls = replica_urls(fleet)
    homes = {}
    for tenant in range(4):
        first = _complete(fleet, tenant_prompt(tenant, 0)).headers["x-servelm-replica"]
        # Wait for the replica's events to reach the router's index.
        wait_until(lambda first=first: admin(fleet)[first]["kv_index_blocks"] >= 16, what="KV events at the router")
        hits_before = {url: metric(url, "servelm:prefix_cache_hits_total") for url in urls}
        served = {_complete(fleet, tenant_prompt(tenant, q)).headers["x-servelm-replica"] for q in range(1, 5)}
        assert served == {first}
        hits = {url: metric(url, "servelm:prefix_cache_hits_total") - hits_before[url] for url in urls}
        assert hits[first] >= 4 * 256, hits  # the ~300-token system prompt came from cache every time
        assert all(hits[url] == 0 for url in urls if url != first), hits
        homes[tenant] = first
    router_metrics = httpx.get(f"{router_url(fleet)}/metrics", timeout=10).text
    assert 'routing_decisions_total{reason="kv_hit"} 16.0' in router_metrics


def test_admin_removes_and_adds_replicas(fleet: LocalCluster) -> None:
    victim = fleet.processes[0].spec
    response = httpx.request("DELETE", f"{router_url(fleet)}/admin/replicas", json={"url": victim.url}, headers=AUTH)
    assert response.status_code == 200 and response.json()["removed"]
    assert victim.url not in admin(fleet)
    served = {_complete(fleet, tenant_prompt(9, q)).headers["x-servelm-replica"] for q in range(6)}
    assert victim.url not in served
    body = {"url": victim.url, "kv_events": victim.kv_events}
    response = httpx.post(f"{router_url(fleet)}/admin/replicas", json=body, headers=AUTH, timeout=10)
    assert response.status_code == 201 and response.json()["healthy"]
    wait_until(lambda: admin(fleet)[victim.url]["kv_synced"], what="resync of the re-added replica")


def test_client_going_away_mid_stream_releases_the_replica(fleet: LocalCluster) -> None:
    body = {"prompt": tenant_prompt(1, 7), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router_url(fleet)}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        replica = response.headers["x-servelm-replica"]
        lines = response.iter_lines()  # kept: a dropped line iterator closes the connection at once
        next(lines)
        assert admin(fleet)[replica]["in_flight"] == 1
    # Closed after one chunk: the router must close upstream (the replica aborts) and drop its count.
    wait_until(lambda: all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0 for r in admin(fleet).values()),
               what="in-flight counts back to 0")  # fmt: skip
    wait_until(lambda: metric(replica, "servelm:num_requests_running") == 0, what="the replica to abort the stream")


def test_client_going_away_before_a_whole_answer_aborts_it_on_the_replica(fleet: LocalCluster) -> None:
    """Not streamed: the router waits for the whole answer before it sends a byte, and must still
    notice the client leaving meanwhile (before: the replica computed all of it for nobody)."""
    body = {"prompt": tenant_prompt(2, 9), "max_tokens": 600, "ignore_eos": True, "n": 2}
    aborted = 'finished_reason="abort"'
    before = {url: metric_with(url, "servelm:request_success_total", aborted) for url in replica_urls(fleet)}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router_url(fleet)}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(30, read=0.5))
    wait_until(lambda: sum(metric_with(url, "servelm:request_success_total", aborted) - before[url]
                           for url in replica_urls(fleet)) == 2, what="the replica to abort both choices")  # fmt: skip
    wait_until(lambda: all(r["in_flight"] == 0 for r in admin(fleet).values()), what="in-flight counts back to 0")


def test_tokenize_and_detokenize_pass_through(fleet: LocalCluster) -> None:
    direct = httpx.post(f"{replica_urls(fleet)[0]}/tokenize", json={"prompt": "hi there"}, timeout=10).json()
    routed = httpx.post(f"{router_url(fleet)}/tokenize", json={"prompt": "hi there"}, headers=AUTH, timeout=10)
    assert routed.status_code == 200 and routed.json() == direct
    text = httpx.post(f"{router_url(fleet)}/detokenize", json={"tokens": direct["tokens"]}, headers=AUTH, timeout=10)
    assert text.status_code == 200 and "hi there" in text.json()["prompt"]


def _set_rotation(fleet: LocalCluster, remove: list[str], add: list[dict]) -> None:
    for url in remove:
        response = httpx.request("DELETE", f"{router_url(fleet)}/admin/replicas", json={"url": url}, headers=AUTH)
        assert response.status_code == 200, response.text
    for body in add:
        response = httpx.post(f"{router_url(fleet)}/admin/replicas", json=body, headers=AUTH, timeout=10)
        assert response.status_code == 201, response.text
    wait_until(lambda: all(admin(fleet)[b["url"]]["healthy"] for b in add), what="added replicas in rotation")


def test_a_full_replica_answers_429_and_the_router_tries_another(fleet: LocalCluster) -> None:
    # A third replica whose waiting queue admits nothing: every request it gets is a 429.
    extra = ["--num-blocks", "256", "--num-threads", "1", "--max-waiting-requests", "0"]
    with launch_server(fleet.config.model, extra) as full:
        probe = httpx.post(f"{full.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        assert probe.status_code == 429
        normal = [p.spec for p in fleet.processes if p.spec.role == "replica"]
        # One normal replica and the full one: the full one is the idle one, so it is chosen often.
        _set_rotation(fleet, remove=[normal[0].url], add=[{"url": full.base_url}])
        try:
            async def burst() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=120) as client:
                    return await asyncio.gather(*(_fire(client, router_url(fleet), i) for i in range(8)))

            responses = asyncio.run(burst())
            assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses if r.status_code != 200]
            assert {r.headers["x-servelm-replica"] for r in responses} == {normal[1].url}
            series = f'servelm:router_requests_total{{replica="{full.base_url}"}} '
            text = httpx.get(f"{router_url(fleet)}/metrics", timeout=10).text
            sent_to_full = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))
            assert sent_to_full > 0, "the full replica was never tried: the test proves nothing"
            # Only the full replica left: the fleet is full, so the client gets 429, not 503.
            _set_rotation(fleet, remove=[normal[1].url], add=[])
            response = httpx.post(f"{router_url(fleet)}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                                  headers=AUTH, timeout=30)  # fmt: skip
            assert response.status_code == 429 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "rate_limit_error"
        finally:
            _set_rotation(fleet, remove=[full.base_url], add=[])
            for spec in normal:
                if spec.url not in admin(fleet):
                    _set_rotation(fleet, remove=[], add=[{"url": spec.url, "kv_events": spec.kv_events}])
            wait_until(lambda: all(r["kv_synced"] for r in admin(fleet).values()), what="resync of re-added replicas")


async def _fire(client: httpx.AsyncClient, url: str, i: int) -> httpx.Response:
    body = {"prompt": tenant_prompt(i % 6, 100 + i), "max_tokens": 160, "ignore_eos": True}
    return await client.post(f"{url}/v1/completions", json=body, headers=AUTH)


async def _kill_during_load(fleet: LocalCluster) -> tuple[list[httpx.Response], str]:
    url = router_url(fleet)
    async with httpx.AsyncClient(timeout=180) as client:
        tasks = [asyncio.create_task(_fire(client, url, i)) for i in range(12)]
        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            busy = {u: r for u, r in admin(fleet).items() if r["in_flight"] > 0}
            victim = next((p for p in fleet.processes if p.spec.url in busy), None)
        assert victim is not None, "no replica ever had requests in flight"
        victim.process.kill()  # SIGKILL: no drain, connections reset mid-request
        return await asyncio.gather(*tasks), victim.spec.url


def test_a_batch_through_the_router_is_spread_over_the_replicas(fleet: LocalCluster) -> None:
    """The Batch API on the router: one batch's lines routed like any request, over both replicas."""
    before = {url: r["num_requests"] for url, r in admin(fleet).items()}
    lines = [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Row {i}: " + "the table has columns " * (i % 5 + 1), "max_tokens": 16,
                       "temperature": 0, "ignore_eos": True}} for i in range(40)]  # fmt: skip
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = httpx.post(f"{router_url(fleet)}/v1/files", headers=AUTH, data={"purpose": "batch"},
                          files={"file": ("rows.jsonl", content)}, timeout=30)  # fmt: skip
    assert uploaded.status_code == 200, uploaded.text
    created = httpx.post(f"{router_url(fleet)}/v1/batches", headers=AUTH, timeout=30,
                         json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions",
                               "completion_window": "24h"}).json()  # fmt: skip

    def batch() -> dict:
        return httpx.get(f"{router_url(fleet)}/v1/batches/{created['id']}", headers=AUTH, timeout=10).json()

    wait_until(lambda: batch()["status"] == "completed", timeout_s=120, what="the batch to complete")
    done = batch()
    assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    output = httpx.get(f"{router_url(fleet)}/v1/files/{done['output_file_id']}/content", headers=AUTH, timeout=30).text
    results = [json.loads(x) for x in output.splitlines()]
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]
    direct = httpx.post(f"{router_url(fleet)}/v1/completions", headers=AUTH, json=lines[7]["body"], timeout=30).json()
    assert results[7]["response"]["body"]["choices"][0]["text"] == direct["choices"][0]["text"]
    after = {url: r["num_requests"] for url, r in admin(fleet).items()}
    assert all(after[url] > before[url] for url in before), (before, after)  # both replicas served lines


def test_killing_a_replica_mid_run_loses_no_unstarted_request(fleet: LocalCluster) -> None:
    retries_before = metric(router_url(fleet), "servelm:router_retries_total")
    responses, dead = asyncio.run(_kill_during_load(fleet))
    # Non-streamed requests have sent no byte until they finish: every one must be retried and succeed.
    assert [r.status_code for r in responses] == [200] * len(responses), [r.text[:200] for r in responses]
    assert metric(router_url(fleet), "servelm:router_retries_total") > retries_before
    assert admin(fleet)[dead]["healthy"] is False
    served = {_complete(fleet, tenant_prompt(q, q)).headers["x-servelm-replica"] for q in range(6)}
    assert served and dead not in served
