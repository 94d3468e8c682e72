"""The API process's own health metrics on a real server: the event-loop lag is sampled, and the
output backlog grows for a client that stops reading a stream while it stays near 0 for one that reads.

A client that does not read: its socket's receive window fills, then the server's send buffer
and the transport's, then each SSE write blocks; the engine keeps generating, so outputs pile
up in the stream's queue (the gauge, now) and the stream ends with them untaken (the histogram).
The stream is made heavy (16 choices, 20 logprobs each: ~10 kB per engine step, ~9 MB in all)
so the socket buffers on loopback (the server's send buffer grows to Linux's default cap of
4 MB, `net.ipv4.tcp_wmem`) fill within a few hundred of its 900 steps.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers_http import metric_value, scrape, wait_idle

HEAVY_STREAM = {"prompt": "Nobody reads this stream", "max_tokens": 900, "ignore_eos": True, "n": 16,
                "logprobs": 20, "stream": True}  # fmt: skip
BACKLOG = "servelm:stream_output_backlog"


def _backlog_buckets(text: str) -> dict[float, float]:
    """le → cumulative count of the output-backlog histogram, summed over priority classes."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == BACKLOG + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


def _new_samples(before: str, after: str) -> dict[float, float]:
    old, new = _backlog_buckets(before), _backlog_buckets(after)
    return {le: new[le] - old.get(le, 0.0) for le in new}


def test_event_loop_lag_is_sampled(server):
    first = metric_value(scrape(server), "servelm:api_event_loop_lag_seconds_count")
    time.sleep(0.5)
    second = metric_value(scrape(server), "servelm:api_event_loop_lag_seconds_count")
    assert second - first >= 3, f"a 50 ms sampler took only {second - first:.0f} samples in 500 ms"


def test_a_reading_client_keeps_the_backlog_near_zero(server):
    before = scrape(server)
    body = {**HEAVY_STREAM, "n": 2, "logprobs": 5, "max_tokens": 300}
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            num_chunks = sum(1 for line in response.iter_lines() if line.startswith("data: {"))
    assert num_chunks >= 100
    after = wait_idle(server)
    new = _new_samples(before, after)
    total = new[float("inf")]
    assert total >= 100, f"one sample per batch the stream took, got {total:.0f}"
    assert new[0.0] >= 0.5 * total, f"most batches should find nothing waiting: {new}"
    assert new[50.0] == total, f"a reading client fell more than 50 outputs behind: {new}"
    assert metric_value(after, "servelm:num_outputs_queued_in_api") == 0


def test_a_client_that_stops_reading_builds_a_backlog(server):
    before = scrape(server)
    payload = json.dumps(HEAVY_STREAM).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload  # fmt: skip
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: set before connect
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(request)
        deadline = time.monotonic() + 90
        queued = 0.0
        while queued < 1000 and time.monotonic() < deadline:
            time.sleep(0.2)
            queued = metric_value(scrape(server), "servelm:num_outputs_queued_in_api")
        if queued < 1000:
            pytest.fail(f"outputs queued for a client that reads nothing stayed at {queued:.0f} "
                        "(a send buffer cap above 4 MB, net.ipv4.tcp_wmem, can absorb the whole stream)")  # fmt: skip
    # The client left: the stream is cancelled with its outputs untaken, and that is one sample.
    after = wait_idle(server)
    new = _new_samples(before, after)
    assert new[float("inf")] - new[500.0] >= 1, f"no stream ended with 500+ outputs waiting: {new}"
    assert metric_value(after, "servelm:num_outputs_queued_in_api") == 0
