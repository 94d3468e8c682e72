"""The router's own overload guard in front of a real replica (issue 17, part 5): bodies over its
limit refused unread, requests in flight limited, the client's address passed on to the replica
(X-Forwarded-For: the replica's per-client limit counts the client, not the router), and a client
that never reads cut by the router, which closes the upstream stream so the replica aborts the
request long before its own stall timeout."""

from __future__ import annotations

import time

import httpx
import pytest

from router_helpers import tiny_fleet
from servelm.cluster.local import LocalCluster
from servelm.router.limits import forwarded_for
from servelm.testing.overload import HEAVY_STREAM, RssSampler, StalledStream

ROUTER_STALL_S = 8.0  # long enough to hold slots while the limits are probed
HELD_STREAM = {**HEAVY_STREAM, "max_tokens": 10}  # 7 MB at once: nothing reads it, nothing completes it


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def wait_for(condition, timeout_s: float, what: str) -> float:
    """Seconds until `condition()` held; AssertionError after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def guarded_fleet(tmp_path_factory: pytest.TempPathFactory):
    replica_args = ("--num-blocks", "1024", "--max-concurrent-requests-per-client", "1", "--stream-stall-timeout-s",
                    "120", "--max-stream-backlog", "0")  # fmt: skip
    router_args = ("--max-request-body-mb", "1", "--max-concurrent-requests", "2", "--stream-stall-timeout-s",
                   str(ROUTER_STALL_S))  # fmt: skip
    with tiny_fleet(tmp_path_factory.mktemp("guarded-fleet"), 1, replica_args, router_args, "round_robin") as cluster:
        yield cluster


def _urls(fleet: LocalCluster) -> tuple[str, str]:
    urls = fleet.urls()
    return urls["router"], urls["replica-0"]


def _replica_idle(replica: str) -> bool:
    return all(metric(replica, f"servelm:{name}") == 0 for name in ("num_requests_running", "kv_cache_used_blocks",
                                                                      "num_requests_in_api"))  # fmt: skip


def test_a_body_over_the_limit_is_refused_unread(guarded_fleet):
    router, _ = _urls(guarded_fleet)
    sent = metric(router, "servelm:router_requests_total")
    big = {"prompt": "a" * (2 << 20), "max_tokens": 1}
    response = httpx.post(f"{router}/v1/completions", json=big, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large", response.text

    def chunked():  # no Content-Length: refused once 1 MB has arrived
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"a" * 65536
        yield b'"}'

    response = httpx.post(f"{router}/v1/completions", content=chunked(), headers={"Content-Type": "application/json"},
                          timeout=30)  # fmt: skip
    assert response.status_code == 413, response.text
    assert metric(router, "servelm:router_requests_total") == sent, "nothing was forwarded"
    ok = httpx.post(f"{router}/v1/completions", json={"prompt": "a" * 1000, "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_forwarded_for_appends_the_client():
    assert forwarded_for([(b"host", b"x")], "10.0.0.1") == [(b"host", b"x"), (b"x-forwarded-for", b"10.0.0.1")]
    given = [(b"X-Forwarded-For", b"1.2.3.4"), (b"host", b"x")]
    assert forwarded_for(given, "10.0.0.1") == [(b"host", b"x"), (b"x-forwarded-for", b"1.2.3.4, 10.0.0.1")]


def test_limits_count_clients_through_the_router(guarded_fleet):
    router, replica = _urls(guarded_fleet)
    port = int(router.rsplit(":", 1)[1])
    body = {"prompt": "hi", "max_tokens": 2}
    clients = [httpx.Client(base_url=router, timeout=30, transport=httpx.HTTPTransport(local_address=f"127.0.0.{i}"))
               for i in (1, 2, 3)]  # fmt: skip
    held = [StalledStream.open(port, "/v1/completions", HELD_STREAM, source="127.0.0.1")]
    try:
        assert held[0].read_head().startswith(b"HTTP/1.1 200")
        # The replica allows 1 request per client, and sees this one's address, not the router's:
        refused = clients[0].post("/v1/completions", json=body)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1", refused.text
        assert clients[1].post("/v1/completions", json=body).status_code == 200
        held.append(StalledStream.open(port, "/v1/completions", HELD_STREAM, source="127.0.0.2"))
        assert held[1].read_head().startswith(b"HTTP/1.1 200")
        # 2 in flight: the router's own limit, before anything reaches the replica.
        refused = clients[2].post("/v1/completions", json=body)
        assert refused.status_code == 429 and "--max-concurrent-requests" in refused.json()["error"]["message"]
        assert httpx.get(f"{router}/health", timeout=10).status_code == 200
    finally:
        for stalled in held:
            stalled.close()
    wait_for(lambda: clients[2].post("/v1/completions", json=body).status_code == 200, 30, "slots freed")
    wait_for(lambda: _replica_idle(replica), 30, "the replica idle")
    for client in clients:
        client.close()


def test_a_client_that_never_reads_is_cut_by_the_router(guarded_fleet):
    """The router reads the replica only as fast as its client reads (its writes wait, it stops
    reading upstream): nothing piles up in the router. After the stall timeout it cuts the client
    and closes the upstream stream; the replica aborts the request (its own timeout is 120 s)."""
    router, replica = _urls(guarded_fleet)
    port = int(router.rsplit(":", 1)[1])
    cut_before = metric(router, "servelm:router_streams_cut_total")
    pids = {p.spec.name: p.process.pid for p in guarded_fleet.processes}
    with RssSampler(pids) as rss:
        with StalledStream.open(port, "/v1/completions", HEAVY_STREAM) as stalled:
            assert stalled.read_head().startswith(b"HTTP/1.1 200")
            cut_s = wait_for(lambda: metric(router, "servelm:router_streams_cut_total") > cut_before, 60, "the cut")
            wait_for(lambda: _replica_idle(replica), 20, "the replica to abort the request")
            _, closed = stalled.drain_to_eof(timeout_s=30)
            assert closed
    assert ROUTER_STALL_S - 1 <= cut_s < ROUTER_STALL_S + 30, cut_s
    print(f"cut after {cut_s:.1f} s; RSS {rss.report()}")
    growth = rss.growth_mb()
    assert growth["router"] < 64, rss.report()  # the router buffers nothing beyond its socket's ~64 kB
    assert growth["replica-0"] < 256, rss.report()
