"""Prefill/decode disaggregation through two real `servelm serve` processes (a prefill worker and a
decode worker on the tiny model), driven over HTTP the way the router drives them: the producer
half and the consumer half of one request sent at once under one transfer id.

Greedy output equals the aggregated output, whatever happens to the transfer: a pull that gets
everything, a prefill worker frozen or killed mid-pull, a pull past its timeout, a pull cap that
makes requests wait or compute, and a corrupted block. Every path ends with both workers' pools
back at baseline (no blocks used, no export held)."""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from helpers_http import metric_value, scrape, wait_idle
from servelm.server.launcher import ServerProcess, launch_server

BLOCK = 16
WORKER_ARGS = ["--num-blocks", "256", "--block-size", str(BLOCK), "--max-num-seqs", "16", "--num-threads", "1"]
PREFILL_ARGS = [*WORKER_ARGS, "--kv-role", "prefill", "--kv-transfer-hold-s", "2"]
# Small prefill chunks make a long prompt's prefill take many steps, so its pull streams.
SLOW_PREFILL_ARGS = [*PREFILL_ARGS, "--max-num-batched-tokens", "32", "--long-prefill-token-threshold", "32"]
DECODE_ARGS = [*WORKER_ARGS, "--kv-role", "decode", "--kv-transfer-wait-s", "1"]
# 40 blocks of pulls at most: a 300-token prompt wants 18, so two pull at once and the rest wait.
CAPPED_DECODE_ARGS = [*DECODE_ARGS, "--kv-transfer-max-reserved-blocks", "40"]
MAX_TOKENS = 12


def transfer_address(server: ServerProcess) -> str:
    info = httpx.get(f"{server.base_url}/v1/kv_transfer", timeout=10).json()
    return info["address"]


def complete(server: ServerProcess, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def disaggregated(prefill: ServerProcess, decode: ServerProcess, prompt: list[int], **decode_extra) -> dict:
    """Both halves at once, as the router sends them; returns the decode worker's response."""
    transfer_id = uuid.uuid4().hex
    producer = {"do_remote_decode": True, "transfer_id": transfer_id}
    consumer = {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_address": transfer_address(prefill)}
    with ThreadPoolExecutor(2) as pool:
        prefill_call = pool.submit(complete, prefill, prompt, 1, kv_transfer_params=producer)
        decoded = complete(decode, prompt, kv_transfer_params=consumer, **decode_extra)
        prefill_call.result()
    return decoded


def text(response: dict) -> str:
    return response["choices"][0]["text"]


def pulled_bytes(server: ServerProcess) -> float:
    return metric_value(scrape(server), "servelm:kv_transfer_bytes_total", 'direction="load",medium="remote"')


def assert_baseline(*servers: ServerProcess) -> None:
    """No request, no used block, no export held: nothing leaked on any path."""
    for server in servers:
        metrics = wait_idle(server)
        # An export nobody pulls lets go after --kv-transfer-hold-s (2 s here): wait for that by the
        # clock (a count of scrapes was machine speed: ~60 quick scrapes can end before the hold).
        deadline = time.monotonic() + 15
        while metric_value(metrics, "servelm:num_kv_exports_held") and time.monotonic() < deadline:
            time.sleep(0.1)
            metrics = wait_idle(server)
        assert metric_value(metrics, "servelm:num_kv_exports_held") == 0
        assert metric_value(metrics, "servelm:num_kv_pulls_in_flight") == 0


@contextmanager
def workers(
    tiny_model_dir: Path, prefill_args=PREFILL_ARGS, decode_args=DECODE_ARGS
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with launch_server(tiny_model_dir, prefill_args) as prefill:
        with launch_server(tiny_model_dir, [*decode_args, "--kv-transfer-peers", transfer_address(prefill)]) as decode:
            yield prefill, decode


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A slow-prefill producer and a consumer, shared by this module's tests (a server start
    is ~10 s of a 2-core host). Each test leaves both at baseline and reads their counters as
    deltas; a test that kills or freezes a producer, or needs other consumer flags, starts its own."""
    with workers(tiny_model_dir, prefill_args=SLOW_PREFILL_ARGS) as both:
        yield both


def load_failures(server: ServerProcess) -> float:
    return metric_value(scrape(server), "servelm:kv_load_failures_total")


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


def test_disaggregated_greedy_output_is_the_aggregated_output(pair: tuple[ServerProcess, ServerProcess]):
    rng = random.Random(5)
    shared = [rng.randrange(1, 500) for _ in range(3 * BLOCK)]
    cases = prompts(6, [5, 17, 40, 64, 200, 333]) + [shared + p for p in prompts(7, [20, 90])]
    prefill, decode = pair
    # The reference: the same server computing alone (its own namespace: no help from pulled blocks).
    expected = [text(complete(decode, p, cache_salt="aggregated")) for p in cases]
    before = pulled_bytes(decode)
    got = [text(disaggregated(prefill, decode, p)) for p in cases]
    assert got == expected
    assert pulled_bytes(decode) > before
    # Prefix hits on either side: the shared prefix is cached on both now, the rest still pulls.
    again = shared + prompts(8, [70])[0]
    assert text(disaggregated(prefill, decode, again)) == text(complete(decode, again, cache_salt="aggregated"))
    metrics = scrape(decode)
    assert metric_value(metrics, "servelm:kv_pull_seconds_count") >= len(cases)  # cumulative: only grows
    assert metric_value(metrics, "servelm:ttft_component_seconds_count", 'component="kv_transfer"') >= 1
    assert_baseline(prefill, decode)


def test_bad_kv_transfer_params_are_400s(pair: tuple[ServerProcess, ServerProcess], server: ServerProcess):
    """`server`: the session's plain server (no --kv-role)."""
    _, decode = pair
    cases = [
        {"do_remote_decode": True, "transfer_id": "t"},  # a decode-only server cannot prefill for others
        {"do_remote_prefill": True, "transfer_id": "t"},  # no remote_address
        {"do_remote_prefill": True, "do_remote_decode": True, "transfer_id": "t", "remote_address": "tcp://x:1"},
        {"do_remote_prefill": True, "transfer_id": "t", "remote_address": "http://127.0.0.1:1"},
        {"do_remote_prefill": True, "transfer_id": "t", "remote_address": "tcp://127.0.0.1:1", "extra": 1},
    ]
    for params in cases:
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": params}
        response = httpx.post(f"{decode.base_url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, (params, response.text)
        assert response.json()["error"]["param"].startswith("kv_transfer_params")
    assert httpx.get(f"{decode.base_url}/v1/kv_transfer", timeout=10).json()["address"] is None
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 2,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t"},
    }
    assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).status_code == 400
    assert httpx.get(f"{server.base_url}/v1/kv_transfer", timeout=10).status_code == 404


def test_a_dead_or_frozen_prefill_worker_costs_a_recompute_not_the_request(
    tiny_model_dir: Path, pair: tuple[ServerProcess, ServerProcess]
):
    frozen_prompt, dead_prompt = prompts(9, [1000, 600])
    _, decode = pair  # the producer is this test's own: it is frozen, then killed
    failures = load_failures(decode)
    with launch_server(tiny_model_dir, SLOW_PREFILL_ARGS) as prefill:
        expected = [text(complete(decode, p, cache_salt="aggregated")) for p in (frozen_prompt, dead_prompt)]
        address = transfer_address(prefill)
        # Frozen while the decode worker's pull is open: its heartbeats stop, the decode worker
        # gives the peer up after --kv-transfer-wait-s and computes the prompt itself; then the
        # prefill worker dies with the producer half of the request in it.
        transfer_id = uuid.uuid4().hex
        consumer = {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_address": address}
        with ThreadPoolExecutor(2) as pool:
            decoded = pool.submit(complete, decode, frozen_prompt, kv_transfer_params=consumer)
            _wait_for(lambda: metric_value(scrape(decode), "servelm:num_kv_pulls_in_flight") == 1)
            os.kill(prefill.process.pid, signal.SIGSTOP)
            producer = {"do_remote_decode": True, "transfer_id": transfer_id}
            pool.submit(_quietly, complete, prefill, frozen_prompt, 1, kv_transfer_params=producer)
            try:
                assert text(decoded.result(timeout=60)) == expected[0]
            finally:
                os.kill(prefill.process.pid, signal.SIGKILL)
                os.kill(prefill.process.pid, signal.SIGCONT)
        assert load_failures(decode) == failures + 1
        # Dead before the request: the pull fails fast and the decode worker computes.
        started = _now()
        assert text(disaggregated_to_dead_peer(decode, dead_prompt, address)) == expected[1]
        assert _now() - started < 10
        assert load_failures(decode) == failures + 2
        assert_baseline(decode)


def disaggregated_to_dead_peer(decode: ServerProcess, prompt: list[int], address: str) -> dict:
    consumer = {"do_remote_prefill": True, "transfer_id": uuid.uuid4().hex, "remote_address": address}
    return complete(decode, prompt, kv_transfer_params=consumer)


def test_a_pull_past_its_timeout_is_cancelled_and_computed(
    tiny_model_dir: Path, pair: tuple[ServerProcess, ServerProcess]
):
    prompt = prompts(10, [400])[0]
    prefill, _ = pair
    # This consumer's own flags: a pull ends at 1 s, long before the producer's 2 s hold gives it up.
    decode_args = [*WORKER_ARGS, "--kv-role", "decode", "--kv-transfer-wait-s", "30", "--kv-transfer-timeout-s", "1"]
    with launch_server(tiny_model_dir, decode_args) as decode:
        expected = text(complete(decode, prompt, cache_salt="aggregated"))
        # The producer half never comes: the export is unknown and the pull would wait 30 s for it.
        started = _now()
        assert text(disaggregated_to_dead_peer(decode, prompt, transfer_address(prefill))) == expected
        assert _now() - started < 10
        assert_baseline(prefill, decode)


def test_the_pull_cap_makes_requests_wait_or_compute_never_starve(
    tiny_model_dir: Path, pair: tuple[ServerProcess, ServerProcess]
):
    cases = prompts(11, [300] * 5)
    prefill, _ = pair
    with launch_server(
        tiny_model_dir, [*CAPPED_DECODE_ARGS, "--kv-transfer-peers", transfer_address(prefill)]
    ) as decode:
        expected = [text(complete(decode, p, cache_salt="aggregated")) for p in cases]
        with ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(lambda p: text(disaggregated(prefill, decode, p)), cases))
        assert got == expected
        # One prompt larger than the whole cap: it computes instead of waiting forever.
        big = prompts(12, [700])[0]
        assert text(disaggregated(prefill, decode, big)) == text(complete(decode, big, cache_salt="aggregated"))
        assert_baseline(prefill, decode)


def test_a_corrupt_block_is_caught_and_the_rest_computed(
    tiny_model_dir: Path, pair: tuple[ServerProcess, ServerProcess]
):
    prompt = prompts(13, [250])[0]
    env = {**os.environ, "SERVELM_FAULT_KV_CORRUPT_EVERY": "3"}
    _, decode = pair  # the producer is this test's own: it corrupts every third block it sends
    failures, pulled = load_failures(decode), pulled_bytes(decode)
    with launch_server(tiny_model_dir, PREFILL_ARGS, env=env) as prefill:
        expected = text(complete(decode, prompt, cache_salt="aggregated"))
        assert text(disaggregated(prefill, decode, prompt)) == expected
        assert load_failures(decode) >= failures + 1
        assert pulled_bytes(decode) > pulled
        assert_baseline(prefill, decode)


def _quietly(function, *args, **kwargs):
    try:
        return function(*args, **kwargs)
    except (httpx.HTTPError, AssertionError):  # the frozen-then-killed prefill worker's own call fails: expected
        return None


def _now() -> float:
    return time.monotonic()


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    pytest.fail("condition not reached")
