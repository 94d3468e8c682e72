"""Load (issue 17): 500 concurrent streams through the router on 2 replicas of a tiny model, real
processes: every stream completes whole (200, every token, [DONE]), and the memory of every
process (router, each replica's API process and engine core) stays within a bound while they run.

The 500 streams are open at once: each replica admits 256 (--max-num-seqs) and queues the rest,
the router holds 500 client and 500 upstream connections (its pool allows 4096), and the clients
all read. What a stream costs the router and an API process is a connection on each hop, a
request's state and a few kB of output in passing (measured: +31 MB for the router, +8 MB per
API process, over idle); the bound catches 256 kB held per stream, or anything buffered without
limit. An engine core grows with its batch, not with the streams: 256 sequences' logits over the
49152-token vocabulary and the sampler's temporaries (measured: +234 MB).

About 25 CPU-seconds in all (engine cores, router and this client each a quarter): `slow`.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time

import httpx
import pytest

from router_helpers import tiny_fleet
from servelm.cluster.local import LocalCluster
from servelm.testing.overload import RssSampler
from servelm.testing.processes import child_pids

NUM_STREAMS = 500
MAX_TOKENS = 8
MAX_GROWTH_MB = {"router": 128, "replica": 128, "core": 512}  # per process, peak over idle


@pytest.fixture(scope="module")
def load_fleet(tmp_path_factory: pytest.TempPathFactory):
    replica_args = ("--num-blocks", "2048", "--max-num-seqs", "256", "--max-num-batched-tokens", "4096")
    with tiny_fleet(tmp_path_factory.mktemp("load-fleet"), 2, replica_args, ()) as cluster:
        yield cluster


def _processes(fleet: LocalCluster) -> dict[str, int]:
    """Every process of the fleet by name: the router, each replica and its engine core."""
    pids = {}
    for running in fleet.processes:
        pids[running.spec.name] = running.process.pid
        for core in child_pids(running.process.pid, "spawn_main"):
            pids[f"{running.spec.name}-core"] = core
    return pids


async def _stream(client: httpx.AsyncClient, index: int) -> tuple[int, int, bool]:
    """(status, completion tokens by the usage chunk, whether [DONE] came)."""
    body = {"prompt": f"Request {index} says hello to", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens, done = 0, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return response.status_code, tokens, done


async def _run_all(base_url: str) -> list[tuple[int, int, bool] | BaseException]:
    limits = httpx.Limits(max_connections=NUM_STREAMS, max_keepalive_connections=NUM_STREAMS)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_stream(client, i) for i in range(NUM_STREAMS)), return_exceptions=True)


@pytest.mark.slow
def test_500_concurrent_streams_through_the_router(load_fleet):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * NUM_STREAMS:  # this process holds 500 sockets (the router raises its own limit)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    router = load_fleet.urls()["router"]
    assert asyncio.run(_run_all_warm(router)) == [(200, MAX_TOKENS, True)]  # first-request allocations, not counted
    pids = _processes(load_fleet)
    assert len(pids) == 5, pids
    started = time.monotonic()
    with RssSampler(pids) as rss:
        results = asyncio.run(_run_all(router))
    elapsed = time.monotonic() - started
    failed = [r for r in results if not isinstance(r, tuple) or r != (200, MAX_TOKENS, True)]
    assert not failed, f"{len(failed)} of {NUM_STREAMS} streams failed, e.g. {failed[:3]!r}"
    print(f"{NUM_STREAMS} streams in {elapsed:.1f} s; RSS {rss.report()}")
    for name, growth in rss.growth_mb().items():
        kind = "core" if name.endswith("-core") else name.split("-")[0]
        assert growth < MAX_GROWTH_MB[kind], f"{name} grew {growth:.0f} MB: {rss.report()}"
    # Both replicas served, and everything was released: nothing in flight, nothing running.
    replicas = httpx.get(f"{router}/admin/replicas", timeout=10).json()["replicas"]
    assert all(r["num_requests"] >= NUM_STREAMS // 10 and r["in_flight"] == 0 for r in replicas), replicas


async def _run_all_warm(base_url: str) -> list[tuple[int, int, bool]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return [await _stream(client, -1)]
