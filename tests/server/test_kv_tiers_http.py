"""KV tiers through `servelm serve` over HTTP: a prompt pushed out of a small pool comes back from
host memory with the same greedy text and `usage.prompt_tokens_details.cached_tokens` counting
it; the tier metrics move; and a server restarted on the same --kv-disk-path starts warm."""

from __future__ import annotations

import random
from pathlib import Path

import httpx

from helpers_http import metric_value, scrape
from servelm.server.launcher import ServerProcess, launch_server

# "always": every block found in a tier loads. Under the default "cost" policy the tiny model
# computes a block in ~3 us by its step-cost fit, less than a disk read at the assumed 1 GB/s
# (8 KiB a block), so a fresh replica recomputed its prefix on a fast machine (a CI failure).
POOL_ARGS = ["--num-blocks", "24", "--block-size", "16", "--max-num-seqs", "4", "--num-threads", "1",
             "--kv-load-policy", "always"]  # fmt: skip
PROMPT_TOKENS = 150  # 9 full blocks of 16; three such prompts do not fit in 24 blocks at once


def complete(server: ServerProcess, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def cached_tokens(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prefixes_come_back_from_host_memory_and_disk_across_a_restart(tiny_model_dir: Path, tmp_path: Path):
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 200) for _ in range(PROMPT_TOKENS)] for _ in range(3)]
    disk = str(tmp_path / "kv")
    with launch_server(tiny_model_dir, [*POOL_ARGS, "--kv-offloading-size", "0.01", "--kv-disk-path", disk]) as server:
        first = complete(server, prompts[0])
        assert cached_tokens(first) == 0
        for prompt in prompts[1:]:  # push the first prompt's blocks out of the pool
            complete(server, prompt)
        again = complete(server, prompts[0])
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert cached_tokens(again) == (PROMPT_TOKENS - 1) // 16 * 16  # every full block but the last token's
        metrics = scrape(server)
        assert metric_value(metrics, "servelm:external_prefix_cache_hits_total", 'medium="host"') > 0
        assert metric_value(metrics, "servelm:external_prefix_cache_queries_total", 'medium="disk"') >= 0
        assert metric_value(metrics, "servelm:kv_transfer_bytes_total", 'direction="load",medium="host"') > 0
        assert metric_value(metrics, "servelm:kv_transfer_bytes_total", 'direction="save",medium="host"') > 0
        assert metric_value(metrics, "servelm:kv_tier_usage_bytes", 'medium="host"') > 0
        assert metric_value(metrics, "servelm:kv_load_seconds_count") >= 1
        assert metric_value(metrics, "servelm:ttft_component_seconds_count", 'component="kv_load"') >= 1
    assert server.process.returncode == 0, server.log_tail()
    with launch_server(tiny_model_dir, [*POOL_ARGS, "--kv-disk-path", disk]) as restarted:
        warm = complete(restarted, prompts[1])  # the first request of a fresh replica
        assert cached_tokens(warm) == (PROMPT_TOKENS - 1) // 16 * 16
        metrics = scrape(restarted)
        assert metric_value(metrics, "servelm:external_prefix_cache_hits_total", 'medium="disk"') > 0
