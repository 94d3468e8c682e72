"""The swarm's parts, in one process over real HTTP: who owns a chunk, what a node's peer server
serves and reports while it is half full, when a silent peer counts as gone, and the puller's
wake-up for a chunk a peer just got."""

from __future__ import annotations

import base64
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from servelm.delivery.http_source import HttpSource
from servelm.delivery.local_source import LocalSource
from servelm.delivery.manifest import ChunkRef, read_manifest
from servelm.delivery.pull import Puller
from servelm.delivery.source import NotYetAvailableError
from servelm.delivery.store import ChunkStore
from servelm.delivery.swarm import SwarmConfig, SwarmNode, owner_of
from servelm.delivery.swarm_peers import PeerTable, bitmap_has
from servelm.ports import free_port


def test_each_chunk_has_one_owner_and_a_gone_nodes_share_spreads_evenly():
    positions = range(1000)
    assert [owner_of(p, 4, [0, 1, 2, 3]) for p in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    live = [0, 1, 3]  # node 2 gone
    owners = {p: owner_of(p, 4, live) for p in positions}
    assert all(owners[p] == p % 4 for p in positions if p % 4 != 2), "a live node's share must not move"
    inherited = Counter(owners[p] for p in positions if p % 4 == 2)
    assert set(inherited) == set(live) and max(inherited.values()) - min(inherited.values()) <= 1
    two_gone = Counter(owner_of(p, 4, [1, 3]) for p in positions)
    assert set(two_gone) == {1, 3} and abs(two_gone[1] - two_gone[3]) <= 1
    assert owner_of(5, 4, []) is None


@pytest.fixture
def half_full_node(model_dir: Path, tmp_path: Path):
    """A node (not running its pull) whose store holds every other chunk, its peer server started."""
    url = f"http://127.0.0.1:{free_port()}/"
    node = SwarmNode(LocalSource(str(model_dir)), tmp_path / "node", SwarmConfig(peers=(url,), node_index=0))
    origin = LocalSource(str(model_dir))
    chunks = read_manifest(model_dir).chunks()
    for chunk in chunks[::2]:
        node.store.write(chunk, origin.read(chunk))
    node.server.start()
    yield node, chunks
    node.server.stop()
    node.peers.stop()
    origin.close()


def test_peer_server_serves_held_chunks_only_and_reports_them(half_full_node, model_dir):
    node, chunks = half_full_node
    reader = HttpSource(node.url, connections=2)
    try:
        assert reader.fetch_manifest() == read_manifest(model_dir)
        assert reader.read(chunks[0]) == (model_dir / chunks[0].file).read_bytes()[chunks[0].offset : chunks[0].end]
        missing = next(chunk for chunk in chunks[1::2] if chunk.length)  # an empty file has no bytes to withhold
        with pytest.raises(NotYetAvailableError):
            reader.read(missing)
    finally:
        reader.close()
    late = f"http://127.0.0.1:{free_port()}/"
    held = httpx.get(f"{node.url}_servelm/held", params={"from": late}, timeout=10).json()
    bitmap = base64.b64decode(held["held"])
    assert [bitmap_has(bitmap, p) for p in range(len(chunks))] == [p % 2 == 0 for p in range(len(chunks))]
    assert held["complete"] is False and held["digest"] == read_manifest(model_dir).digest
    assert late in [peer.url for peer in node.peers.snapshot()], "a node that polls us is announced as a peer"
    status = httpx.get(f"{node.url}_servelm/status", timeout=10).json()
    assert (status["held_chunks"], status["chunks"], status["node_index"]) == ((len(chunks) + 1) // 2, len(chunks), 0)


def test_a_peer_that_never_answers_is_gone_after_the_startup_grace_and_one_that_left_after_the_grace():
    me, silent = f"http://127.0.0.1:{free_port()}/", f"http://127.0.0.1:{free_port()}/"
    table = PeerTable(me, [silent, me], digest="x", grace_s=0.2, refresh_s=0.05, startup_grace_s=0.6).start()
    try:
        time.sleep(0.4)
        assert table.live_initial() == [0, 1] and not table.all_live_complete()
        deadline = time.monotonic() + 5
        while table.live_initial() != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert table.live_initial() == [1], "a silent initial node must be declared gone"
        assert table.all_live_complete(), "nobody left to seed for"
    finally:
        table.stop()


class _LatePeerSource(LocalSource):
    """A LocalSource standing in for a swarm whose peer gets one chunk late: reads of it answer
    not-yet (come back in a minute) until the test says it is there; `hold_first` keeps the first
    read of it waiting for the test's go before it answers."""

    def __init__(self, directory: Path, late: str, hold_first: bool) -> None:
        super().__init__(directory)
        self.late, self.reads, self.there = late, Counter[str](), threading.Event()
        self.entered, self.go, self.hold_first = threading.Event(), threading.Event(), hold_first

    def read(self, chunk: ChunkRef) -> bytes:
        self.reads[chunk.key] += 1
        if chunk.key == self.late and not self.there.is_set():
            if self.hold_first and self.reads[chunk.key] == 1:
                self.entered.set()
                assert self.go.wait(10)
            else:
                self.entered.set()
            raise NotYetAvailableError("not on any peer yet", retry_after_s=60)
        return super().read(chunk)


@pytest.mark.parametrize("in_flight", [False, True], ids=["paused", "in-flight"])
def test_wake_asks_again_at_once_instead_of_after_the_pause(model_dir: Path, tmp_path: Path, in_flight: bool):
    manifest = read_manifest(model_dir)
    late = manifest.file("model-00001-of-00002.safetensors").chunks[2]
    source = _LatePeerSource(model_dir, late.key, hold_first=in_flight)
    puller = Puller(source, ChunkStore.open(tmp_path / "dest", manifest), connections=2).start()
    try:
        assert source.entered.wait(10)
        if in_flight:  # the wake lands while the read is still deciding that it is not there
            source.there.set()
            puller.wake([late])
            source.go.set()
        else:
            time.sleep(0.1)  # it pauses for its minute
            source.there.set()
            puller.wake([late])
        stats = puller.wait(timeout_s=5)
    finally:
        puller.stop()
    assert stats.chunks_fetched == len(manifest.chunks()) and source.reads[late.key] == 2
