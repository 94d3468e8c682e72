"""Overload and abuse on a real server (issue 17, part 5): prompts refused by size before they are
tokenized, requests in flight limited in all and per client (429 + Retry-After, before the body
is read), and clients that stop reading cut (stall timeout, output backlog) with their requests
aborted, KV blocks freed and the server's memory bounded."""

from __future__ import annotations

import time

import httpx
import pytest
from pydantic import ValidationError

from helpers_http import metric_value, scrape, wait_idle
from servelm.server.launcher import launch_server
from servelm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest
from servelm.testing.overload import HEAVY_STREAM, RssSampler, StalledStream

STALL_S = 8.0  # the guarded server's --stream-stall-timeout-s: long enough to hold slots, short for the test
BACKLOG = 300  # its --max-stream-backlog: HEAVY_STREAM leaves 1600 outputs behind, HELD_STREAM 160
HELD_STREAM = {**HEAVY_STREAM, "max_tokens": 10}  # blocks at once (7 MB of echo), then waits to be cut by the stall


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


def _max_model_len(base_url: str) -> int:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]


def test_prompts_that_cannot_fit_are_refused_by_size_before_tokenizing(server):
    url = server.base_url
    max_len = _max_model_len(url)
    cases = [
        ("/v1/completions", {"prompt": "a" * (8 << 20), "max_tokens": 1}, "prompt", "characters"),
        ("/v1/completions", {"prompt": ["ok", "b" * (2 << 20)], "max_tokens": 1}, "prompt", "characters"),
        ("/v1/completions", {"prompt": [1] * (4 * max_len), "max_tokens": 1}, "prompt", f"{4 * max_len} in the prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "c" * (8 << 20)}]}, "messages", "characters"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * (max_len + 1)}, "messages",
         f"{max_len + 1} messages"),
    ]  # fmt: skip
    with httpx.Client(base_url=url, timeout=60) as client:
        for path, body, param, says in cases:
            started = time.monotonic()
            response = client.post(path, json=body)
            elapsed = time.monotonic() - started
            assert response.status_code == 400, (path, param, response.text[:300])
            error = _error(response)
            assert error["param"] == param and error["code"] == "context_length_exceeded", error
            assert f"maximum context length is {max_len} tokens" in error["message"] and says in error["message"], error
            assert elapsed < 10, f"{path} {says}: {elapsed:.1f} s"
        # Below the size bound the tokenizer's count decides, exactly as before.
        response = client.post("/v1/completions", json={"prompt": "hello " * (2 * max_len), "max_tokens": 1})
        assert response.status_code == 400 and "in the prompt" in _error(response)["message"], response.text
        assert client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
    wait_idle(server)


@pytest.mark.parametrize(
    "model, body",
    [
        (CompletionRequest, b'{"prompt": [1, ' + b", ".join([b'"x"'] * 200_000) + b"]}"),
        (CompletionRequest, b'{"prompt": "a", "stop_token_ids": [' + b", ".join([b'"x"'] * 200_000) + b"]}"),
        (CompletionRequest, b'{"prompt": "a", "logit_bias": {' + b", ".join(b'"%d": "x"' % i for i in range(200_000)) + b"}}"),
        (ChatCompletionRequest, b'{"messages": [' + b", ".join([b"1"] * 200_000) + b"]}"),
        (DetokenizeRequest, b'{"tokens": [' + b", ".join([b'"x"'] * 200_000) + b"]}"),
    ],
)  # fmt: skip
def test_a_list_of_bad_items_is_refused_at_its_first(model, body):
    """pydantic reports every bad item (and per union member) unless told to stop at the first:
    200k bad items were 200k error objects (a 30 MB body: GBs and seconds)."""
    with pytest.raises(ValidationError) as refused:
        model.model_validate_json(body)
    assert refused.value.error_count() <= 4  # one per union member at most


def _hold(server, source: str = "127.0.0.1") -> StalledStream:
    """A stream that stays in flight: heavy, never read (until the stall timeout cuts it)."""
    stalled = StalledStream.open(server.port, "/v1/completions", HELD_STREAM, source=source)
    head = stalled.read_head()
    assert head.startswith(b"HTTP/1.1 200"), head
    return stalled


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    args = ["--num-blocks", "1024", "--max-num-seqs", "64", "--num-threads", "1", "--max-concurrent-requests", "3",
            "--max-concurrent-requests-per-client", "2", "--stream-stall-timeout-s", str(STALL_S),
            "--max-stream-backlog", str(BACKLOG)]  # fmt: skip
    process = launch_server(tiny_model_dir, args)
    yield process
    assert process.stop() == 0, process.log_tail()


def test_requests_in_flight_are_limited_in_all_and_per_client(guarded):
    body = {"prompt": "hi", "max_tokens": 2}
    one, two, three = (httpx.Client(base_url=guarded.base_url, timeout=30,
                                    transport=httpx.HTTPTransport(local_address=f"127.0.0.{i}")) for i in (1, 2, 3))  # fmt: skip
    held = [_hold(guarded), _hold(guarded)]  # client 127.0.0.1 at its limit of 2
    try:
        refused = one.post("/v1/completions", json=body)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1", refused.text
        assert _error(refused)["code"] == "rate_limit_exceeded"
        assert "(127.0.0.1) has 2 requests in flight" in _error(refused)["message"]
        assert two.post("/v1/completions", json=body).status_code == 200  # another client is not held back
        held.append(_hold(guarded, source="127.0.0.2"))  # 3 in flight: the process's limit
        refused = three.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 429 and "--max-concurrent-requests" in _error(refused)["message"], refused.text
        assert refused.headers["Retry-After"] == "1"
        assert httpx.get(f"{guarded.base_url}/health", timeout=10).status_code == 200  # probes are not limited
        assert one.post("/tokenize", json={"prompt": "hi"}).status_code == 200  # nor what does not generate
    finally:
        for stalled in held:
            stalled.close()
    # A client that leaves frees its slots (uvicorn sees the disconnect at its next write).
    deadline = time.monotonic() + 20
    while (status := three.post("/v1/completions", json=body).status_code) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 200
    wait_idle(guarded)
    for client in (one, two, three):
        client.close()


def test_a_client_that_never_reads_is_cut_and_its_request_aborted(guarded):
    """Without the cut the stream would hold its request's outputs (the engine keeps generating
    into its queue) for as long as the client keeps its socket open."""
    cut_before = metric_value(scrape(guarded), "servelm:streams_cut_total")
    with RssSampler({"api": guarded.process.pid}) as rss:
        with StalledStream.open(guarded.port, "/v1/completions", HELD_STREAM) as stalled:
            assert stalled.read_head().startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            deadline = started + 60
            while metric_value(scrape(guarded), "servelm:streams_cut_total") == cut_before:
                assert time.monotonic() < deadline, "the stalled stream was never cut:\n" + guarded.log_tail()
                time.sleep(0.2)
            cut_after_s = time.monotonic() - started
            wait_idle(guarded)  # aborted in the core: nothing running, no KV blocks held
            # The client sees the bytes buffered for it, then the connection closed without [DONE].
            tail, closed = stalled.drain_to_eof(timeout_s=30)
            assert closed and b"data: [DONE]" not in tail
    assert STALL_S <= cut_after_s < STALL_S + 30, cut_after_s
    print(f"cut after {cut_after_s:.1f} s; RSS {rss.report()}")
    assert "the client took no data for" in guarded.log_tail(20000)
    assert rss.growth_mb()["api"] < 256, rss.report()


def test_a_stream_that_falls_too_far_behind_is_cut_at_once(guarded):
    cut_before = metric_value(scrape(guarded), "servelm:streams_cut_total")
    with StalledStream.open(guarded.port, "/v1/completions", HEAVY_STREAM) as stalled:
        assert stalled.read_head().startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        while metric_value(scrape(guarded), "servelm:streams_cut_total") == cut_before:
            assert time.monotonic() - started < 60, "never cut:\n" + guarded.log_tail()
            time.sleep(0.2)
        _, closed = stalled.drain_to_eof(timeout_s=30)
        assert closed
    wait_idle(guarded)
    assert f"outputs wait for a client that does not keep up (--max-stream-backlog {BACKLOG})" in guarded.log_tail(20000)
    # A client that reads is not cut: 1 MB of 16 choices with logprobs, read as it comes.
    body = {**HEAVY_STREAM, "prompt": "Somebody reads this", "echo": False}
    with httpx.stream("POST", f"{guarded.base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
    assert metric_value(wait_idle(guarded), "servelm:streams_cut_total") == cut_before + 1
