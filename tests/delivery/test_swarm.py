"""Cluster distribution end to end (issue 16): an origin file server and `servelm pull --peers`
nodes, each its own process, deliver a ~110 MB Llama checkpoint (3 shards, 2 MiB chunks).

- three nodes: byte-identical copies, the origin sends the model about once, a node's copy
  loads and generates what the origin's copy generates;
- a node joining after the others completed (they seed) takes everything from them;
- a node SIGKILLed mid-run: the others finish, its share comes from the origin about once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from servelm import LLM, SamplingParams
from servelm.delivery.manifest import MANIFEST_NAME, read_manifest, write_manifest
from servelm.testing.delivery_cluster import (
    Node,
    OriginProcess,
    peer_urls,
    start_node,
    start_origin,
    stop_process,
    wait_nodes,
    wait_until,
)
from servelm.testing.tiny_model import write_random_checkpoint

CHUNK = 2 << 20
ORIGIN_CONNECTIONS = 2
NODE_FLAGS = ["--origin-connections", str(ORIGIN_CONNECTIONS), "--connections", "4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # SmolLM2's shape cut to 7 layers, bf16: ~110 MB in 3 shards, loadable with its tokenizer.
    directory = write_random_checkpoint(tmp_path_factory.mktemp("origin") / "llama", num_hidden_layers=7,
                                        max_shard_bytes=40 << 20)  # fmt: skip
    write_manifest(directory, CHUNK)
    return directory


def model_bytes(directory: Path) -> int:
    return read_manifest(directory).total_bytes


def assert_same_files(origin: Path, copy: Path) -> None:
    for entry in read_manifest(origin).files:
        assert (copy / entry.path).read_bytes() == (origin / entry.path).read_bytes(), entry.path
    assert (copy / MANIFEST_NAME).is_file(), "a complete pull writes the manifest last"


def completed(node: Node) -> bool:
    stats = node.stats()
    return stats is not None and stats["completed_at"] is not None


def test_a_node_killed_mid_run_does_not_stop_the_others(checkpoint, tmp_path):
    # First in the module: the `swarm` fixture's nodes, seeding the same model, would otherwise
    # become these nodes' peers (through the gossip) and serve them what the origin should.
    origin: OriginProcess = start_origin(checkpoint, rate_mb_s=25)  # ~4.5 s for the whole model
    peers = peer_urls(3)
    flags = [*NODE_FLAGS, "--peer-grace-s", "2", "--seed-s", "30"]
    nodes = [start_node(origin.url, tmp_path / f"n{i}", tmp_path / "logs", peers, i, flags) for i in range(3)]
    try:
        def victim_holds_some() -> bool:
            try:
                return httpx.get(f"{peers[2]}_servelm/status", timeout=5).json()["held_chunks"] >= 6
            except httpx.HTTPError:
                return False

        wait_until(victim_holds_some, 60, "node 2 to hold a few chunks")
        nodes[2].process.send_signal(signal.SIGKILL)
        nodes[2].process.wait(10)
        wait_nodes(nodes[:2], timeout_s=60)
        assert not (tmp_path / "n2" / MANIFEST_NAME).exists(), "the kill must land mid-run"
        for node in nodes[:2]:
            assert_same_files(checkpoint, node.directory)
            stats = node.stats()
            assert stats is not None and peers[2] in stats["gone_peers"]
        size, sent = model_bytes(checkpoint), origin.bytes_sent()
        # Beyond the model: what the origin was sending the victim when it died (one chunk per
        # origin connection) and chunks it held that nobody had copied yet (a refresh's worth).
        allowance = (ORIGIN_CONNECTIONS + 2) * CHUNK
        assert sent <= size + allowance, f"origin sent {sent / size:.3f}x the model"
    finally:
        for node in nodes:
            stop_process(node.process)
        origin.stop()


@pytest.fixture(scope="module")
def swarm(checkpoint, tmp_path_factory):
    """Three nodes that completed and keep seeding (--seed-min-s) until the module ends."""
    base = tmp_path_factory.mktemp("swarm")
    origin = start_origin(checkpoint, rate_mb_s=50)
    peers = peer_urls(3)
    flags = [*NODE_FLAGS, "--seed-min-s", "120", "--seed-s", "120"]
    nodes = [start_node(origin.url, base / f"n{i}", base / "logs", peers, i, flags) for i in range(3)]
    try:
        wait_until(lambda: all(completed(node) or node.process.poll() is not None for node in nodes), 90,
                   "three swarm nodes to complete")  # fmt: skip
        for node in nodes:
            assert node.process.poll() is None, f"{node.log_path.name} exited early:\n{node.log()[-3000:]}"
        yield origin, peers, nodes, base
    finally:
        for node in nodes:
            stop_process(node.process)
        origin.stop()


def test_three_nodes_get_identical_copies_with_the_origin_sending_the_model_once(swarm, checkpoint):
    origin, _, nodes, _ = swarm
    size = model_bytes(checkpoint)
    for node in nodes:
        assert_same_files(checkpoint, node.directory)
    sent = origin.bytes_sent()
    assert sent <= 1.05 * size, f"origin sent {sent / size:.3f}x the model"
    stats = [node.stats() for node in nodes]
    assert all(s is not None for s in stats)
    # Every node read about its third from the origin and the rest from peers; the origin's own
    # count and the nodes' add up.
    assert sum(s["origin_bytes"] for s in stats) == sent
    for s in stats:
        assert s["origin_bytes"] + s["peer_bytes"] >= size
        assert s["peer_bytes"] >= 0.5 * size, f"node {s['node_index']} took {s['peer_bytes']} B from peers"


def test_a_nodes_copy_generates_what_the_origins_copy_generates(swarm, checkpoint):
    _, _, nodes, _ = swarm
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = "The quick brown fox"
    local = LLM(str(checkpoint), num_blocks=32).generate([prompt], params)[0].outputs[0].token_ids
    pulled = LLM(str(nodes[1].directory), num_blocks=32).generate([prompt], params)[0].outputs[0].token_ids
    assert pulled == local and len(local) == 6


def test_a_late_joiner_takes_everything_from_seeding_peers(swarm, checkpoint):
    origin, peers, _, base = swarm
    before = origin.bytes_sent()
    late = start_node(origin.url, base / "late", base / "logs", peers, None, NODE_FLAGS)
    wait_nodes([late], timeout_s=60)  # it seeds only for peers not complete: none
    assert_same_files(checkpoint, late.directory)
    stats = late.stats()
    assert stats is not None and stats["node_index"] is None
    assert stats["origin_bytes"] == 0 and stats["peer_bytes"] == model_bytes(checkpoint)
    assert origin.bytes_sent() - before <= 2 * CHUNK
    assert "from the origin" in late.log()  # the summary line
