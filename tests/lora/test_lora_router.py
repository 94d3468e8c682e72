"""LoRA through the router (issue 42), two real replicas behind round robin: a request naming an
adapter only one replica serves goes to that replica every time (the router reads each replica's
/v1/models); a run-time load through the router reaches every replica (then both take its
requests), and an unload through the router leaves it on none."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

from servelm.kv.block_hash import extra_key_of, hash_block_tokens
from servelm.models.hf_loader import read_hf_config
from servelm.router.proxy import REPLICA_HEADER
from servelm.router.request_view import build_view
from servelm.testing.lora_adapters import write_peft_adapter
from servelm.testing.tiny_model import write_tiny_checkpoint
from servelm.tokenization.loading import load_tokenizer
from servelm.tokenization.prompt_tokenizer import PromptTokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))
from router_helpers import tiny_fleet

PROMPT = [1500, 2600, 3700, 4800, 5900]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-fleet")
    with tiny_fleet(root, 2, ["--enable-lora", "--allow-runtime-lora-updating", "--max-lora-rank", "16"], [],
                    policy="round_robin") as cluster:  # fmt: skip
        arch = read_hf_config(root / "model")
        yield cluster, {name: write_peft_adapter(root / name, arch, 8, seed=i) for i, name in enumerate(("a", "b"))}


def _generate(router: str, model: str) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", timeout=60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})  # fmt: skip


def _known(router: str) -> dict[str, list[str]]:
    """The adapters the router believes each replica serves (GET /admin/replicas)."""
    return {r["url"]: r["lora_adapters"] or [] for r in httpx.get(f"{router}/admin/replicas", timeout=10).json()["replicas"]}


def _serves(url: str, model: str) -> bool:
    return any(card["id"] == model for card in httpx.get(f"{url}/v1/models", timeout=10).json()["data"])


def test_requests_for_an_adapter_go_where_it_is_served_and_loads_reach_every_replica(fleet) -> None:
    cluster, adapters = fleet
    router = cluster.urls()["router"]
    replicas = [p.spec.url for p in cluster.processes if p.spec.role == "replica"]
    only = replicas[0]
    assert httpx.post(f"{only}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a"])},
                      timeout=60).status_code == 200  # fmt: skip
    deadline = time.monotonic() + 20
    while "a" not in _known(router).get(only, []):  # until a health pass has read its /v1/models
        assert time.monotonic() < deadline, "the router never learned replica 0's adapter"
        time.sleep(0.2)
    where = {_generate(router, "a").headers[REPLICA_HEADER] for _ in range(6)}
    assert where == {only}  # round robin, but only one replica serves it
    assert {_generate(router, "tiny").headers.get(REPLICA_HEADER) for _ in range(4)} <= set(replicas)

    load = httpx.post(f"{router}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])},
                      timeout=60)  # fmt: skip
    assert load.status_code == 200, load.text
    assert all(_serves(url, "b") for url in replicas)
    assert all("b" in adapters for adapters in _known(router).values())  # known at once, not at the next pass
    assert {_generate(router, "b").headers[REPLICA_HEADER] for _ in range(6)} == set(replicas)

    assert httpx.post(f"{router}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60).status_code == 200
    assert not any(_serves(url, "b") for url in replicas)
    assert _generate(router, "b").status_code == 404


def test_an_adapter_requests_prompt_hashes_in_the_adapters_namespace_as_on_the_replica(tmp_path) -> None:
    """The router hashes a request naming a served adapter with the adapter in the block hash, as
    the replica's prefix cache does (kv/block_hash.extra_key_of); the base model's stays plain."""
    tokenizer = PromptTokenizer(load_tokenizer(str(write_tiny_checkpoint(tmp_path / "model", seed=0))))
    tokens = list(range(100, 164))
    body = {"model": "a", "prompt": tokens}
    view = asyncio.run(build_view(tokenizer, 16, "/v1/completions", body, {}, adapter_names={"a"}))
    assert view.lora_name == "a"
    assert list(view.block_hashes) == hash_block_tokens(tokens, 16, extra_key_of(None, "a"))
    base = asyncio.run(build_view(tokenizer, 16, "/v1/completions", {**body, "model": "tiny"}, {}, adapter_names={"a"}))
    assert base.lora_name is None and list(base.block_hashes) == hash_block_tokens(tokens, 16, None)
    assert base.block_hashes[0] != view.block_hashes[0]
