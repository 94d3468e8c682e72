"""The router knows tiers, end to end: 2 real `servelm serve` replicas of a tiny model, each with a
small KV pool (40 blocks), a host-memory tier (--kv-offloading-size) and KV events, behind a real
`servelm router --policy kv`. A prefix computed on one replica and then pushed out of its pool
by other prompts stays in its host tier: the router's index holds it under medium "host", and the
prefix's next request goes to that replica (reason kv_tier_hit), which loads it from host memory,
not to the other one, where a cache miss of this prefix would land (the rendezvous hash)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from servelm.cluster.local import LocalCluster
from servelm.cluster.spec import ClusterConfig, ReplicasConfig, RouterConfig
from servelm.ports import free_port_range
from servelm.router.policies import rendezvous
from servelm.router.request_view import build_view
from servelm.testing.tiny_model import write_tiny_checkpoint
from servelm.tokenization.loading import load_tokenizer
from servelm.tokenization.prompt_tokenizer import PromptTokenizer

BLOCK_SIZE = 16
POOL_BLOCKS = 40  # 640 tokens: one ~300-token prompt fits, three push the first one out


@pytest.fixture(scope="module")
def tier_fleet(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tier-fleet")
    model = write_tiny_checkpoint(root / "model", seed=0)
    base = free_port_range(1 + 2 * 3)
    # "always": on this tiny model a host load and a recompute cost about the same (2-3 us a
    # block), and the test is about where the router sends the prompt, not the cost call.
    replica_args = ("--num-blocks", str(POOL_BLOCKS), "--max-num-seqs", "4", "--kv-offloading-size", "0.01",
                    "--kv-load-policy", "always")  # fmt: skip
    config = ClusterConfig(
        model=str(model),
        block_size=BLOCK_SIZE,
        replicas=ReplicasConfig(count=2, num_threads=1, base_port=base + 1, kv_events_base_port=base + 3,
                                args=replica_args),
        router=RouterConfig(port=base, policy="kv", args=("--health-interval", "0.5")),
    )  # fmt: skip
    cluster = LocalCluster(config, Path(root / "logs"), startup_timeout_s=240)
    cluster.start()
    yield cluster
    cluster.stop()


def prompt(tenant: int, question: int) -> str:
    system = " ".join(f"tenant{tenant} rule {i} says be careful" for i in range(40))  # ~300 tokens
    return f"{system}\nQuestion {question}: what is {question} plus {tenant}?"


def complete(base_url: str, text: str) -> httpx.Response:
    # max_tokens 1: the sampled token is never fed back, so only prompt blocks are cached.
    body = {"prompt": text, "max_tokens": 1, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def metric(url: str, name: str, label: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith((name + "{", name + " ")) and label in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def admin(router: str) -> dict[str, dict]:
    return {r["url"]: r for r in httpx.get(f"{router}/admin/replicas", timeout=10).json()["replicas"]}


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_prefix_evicted_to_host_memory_is_routed_to_the_replica_holding_it(tier_fleet: LocalCluster) -> None:
    router = tier_fleet.urls()["router"]
    urls = [p.spec.url for p in tier_fleet.processes if p.spec.role == "replica"]
    wait_until(lambda: all(r["kv_synced"] for r in admin(router).values()), "the router's KV index to sync")
    # The replica a miss of this prefix would NOT go to: only its cache can bring the request there.
    tokenizer = PromptTokenizer(load_tokenizer(str(tier_fleet.config.model)))
    view = asyncio.run(build_view(tokenizer, BLOCK_SIZE, "/v1/completions", {"prompt": prompt(0, 1)}, {}))
    tokenizer.shutdown()
    home = min(urls, key=lambda url: rendezvous(view.routing_key, url))
    other = next(url for url in urls if url != home)

    # The prefix, then three other prompts, straight to `home`: the prefix leaves its pool.
    num_blocks = 0
    for tenant in range(4):
        num_blocks += complete(home, prompt(tenant, 0)).json()["usage"]["prompt_tokens"] // BLOCK_SIZE
    assert num_blocks > POOL_BLOCKS
    # Every prompt block went to host memory (write-through); once the router has all of them, it
    # has every event before them too, the pool evictions of the prefix included.
    wait_until(lambda: admin(router)[home]["kv_index_tier_blocks"]["host"] >= num_blocks, "host-tier events")
    assert admin(router)[other]["kv_index_tier_blocks"]["host"] == 0

    host_hits_before = metric(home, "servelm:external_prefix_cache_hits_total", 'medium="host"')
    served = complete(router, prompt(0, 1))
    assert served.headers["x-servelm-replica"] == home
    assert metric(router, "servelm:router_routing_decisions_total", 'reason="kv_tier_hit"') == 1
    host_blocks = metric(router, "servelm:router_matched_blocks_total", 'medium="host"')
    assert host_blocks >= 16 and metric(router, "servelm:router_matched_blocks_total", 'medium="device"') == 0
    # ... and the replica really loaded the prefix from its host tier instead of computing it.
    host_hits = metric(home, "servelm:external_prefix_cache_hits_total", 'medium="host"') - host_hits_before
    assert host_hits == host_blocks * BLOCK_SIZE, (host_hits, host_blocks)
    assert served.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= host_hits
