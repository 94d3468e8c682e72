"""Cluster distribution: N nodes pull one model while the origin sends it about once.

    servelm pull http://origin/llama/ --to DIR --peers http://n0:7070,http://n1:7070,... --node-index I

    node I of N ── chunks at positions I, I+N, I+2N, ... (its share) ──────── from the origin
               ── every other chunk, once a live peer holds it ───────────── from that peer
               ── serves what it holds (a RangeFileServer over its store) ── to the peers

Positions are indices into `Manifest.chunks()`, the same list on every node. How one chunk
is read (`SwarmSource.read`, called by the Puller's threads):

    1. a live peer holds it (its last polled bitmap)   -> from a random such peer
    2. this node owns it (`owner_of`)                  -> from the origin
       or no live initial node is left to fetch it
    3. otherwise                                       -> NotYetAvailableError: the puller asks
                                                          again when a poll shows a peer holds it
                                                          (Puller.wake), or after WAIT_FALLBACK_S

A node fetches its own share first (that is what the others wait for), then the rest in
manifest order, roughly the order the owners fetch theirs. The share of an initial node gone
(swarm_peers.py: not answering for `grace_s`) is spread over the live initial nodes by a
function of the gone set alone, so every node arrives at the same owner and each missing chunk
still comes from the origin about once; what the gone node had already passed on is read from
peers. A node that joins late (no --node-index) owns nothing: it announces itself to the nodes
it polls, reads from peers, and goes to the origin only for chunks no live initial node holds or
will fetch. After completing, a node seeds: it keeps serving until every live peer it knows
reports complete (at least `seed_min_s`, at most `seed_s`), so slower and late nodes are not
sent to the origin.
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from servelm.delivery.file_server import ExtraRoute, RangeFileServer
from servelm.delivery.http_source import HttpSource
from servelm.delivery.manifest import ChunkRef, Manifest
from servelm.delivery.pull import DEFAULT_MAX_ATTEMPTS, Puller
from servelm.delivery.source import ChunkSource, FetchError, NotYetAvailableError
from servelm.delivery.store import ChunkStore
from servelm.delivery.swarm_config import SwarmConfig
from servelm.delivery.swarm_peers import HELD_ROUTE, STATUS_ROUTE, PeerTable, encode_bitmap

logger = logging.getLogger(__name__)

# A chunk nobody holds yet is asked for again when a peer's poll shows it (or the ownership
# changes); this pause only bounds what a missed wake-up could cost. Re-asking every chunk at
# every refresh instead would cost ~40k re-asks per refresh at 700 GB.
WAIT_FALLBACK_S = 2.0


def owner_of(position: int, num_initial: int, live: Sequence[int]) -> int | None:
    """The initial node that fetches chunk `position` from the origin, given the live initial
    nodes (sorted). Its home node (position mod N) while live; otherwise the home node's chunks
    H, H+N, H+2N, ... go round-robin over the live nodes (so a gone node's share spreads evenly);
    None when no initial node is live."""
    home = position % num_initial
    if home in live:
        return home
    return live[(position // num_initial) % len(live)] if live else None


@dataclass
class SwarmStats:
    """One node's account of a distribution (`--stats-json`): summing origin_bytes over the nodes
    gives the origin's egress as the nodes saw it."""

    node: str
    node_index: int | None
    model_bytes: int
    origin_bytes: int = 0  # received from the origin (a duplicate read counts too: it was sent)
    origin_chunks: int = 0
    peer_bytes: int = 0
    peer_chunks: int = 0
    resumed_bytes: int = 0  # held before this run (an interrupted pull's journal)
    served_bytes: int = 0  # sent to peers by this node's server
    started_at: float = 0.0  # unix time
    completed_at: float | None = None  # unix time every chunk was held; None if it never was
    pull_seconds: float = 0.0
    seed_seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process, user + system (hashing, copies, HTTP)
    gone_peers: list[str] = field(default_factory=list)

    def summary(self) -> str:
        gb = 1e9
        rate = (self.origin_bytes + self.peer_bytes) / self.pull_seconds / 1e6 if self.pull_seconds else 0.0
        return (
            f"swarm node {self.node_index if self.node_index is not None else 'late'} ({self.node}): "
            f"{self.model_bytes / gb:.2f} GB in {self.pull_seconds:.1f} s ({rate:.0f} MB/s): "
            f"{self.origin_bytes / gb:.3f} GB from the origin, {self.peer_bytes / gb:.3f} GB from peers, "
            f"{self.resumed_bytes / gb:.3f} GB resumed; served {self.served_bytes / gb:.3f} GB to peers, "
            f"seeded {self.seed_seconds:.1f} s; cpu {self.cpu_seconds:.1f} s"
            + (f"; gone: {', '.join(self.gone_peers)}" if self.gone_peers else "")
        )


class SwarmSource:
    """A ChunkSource over the origin and the peers (the module docstring's three cases)."""

    def __init__(self, origin: ChunkSource, manifest: Manifest, peers: PeerTable, config: SwarmConfig,
                 stats: SwarmStats) -> None:  # fmt: skip
        self.origin = origin
        self.peers = peers
        self.config = config
        self.stats = stats
        self.description = f"swarm of {len(config.peers)} over {origin.description}"
        self._chunks = manifest.chunks()
        self._positions = {chunk.key: position for position, chunk in enumerate(self._chunks)}
        self._origin_slots = threading.BoundedSemaphore(config.origin_connections)
        self._lock = threading.Lock()
        self._peer_sources: dict[str, HttpSource] = {}
        self._origin_waiting: deque[ChunkRef] = deque()  # turned away while every origin connection was busy
        # The puller's `wake` (set by SwarmNode): a freed origin connection calls the next waiting chunk.
        self.wake: Callable[[list[ChunkRef]], int] | None = None

    def fetch_manifest(self) -> Manifest:
        return self.origin.fetch_manifest()

    def order(self, missing: list[ChunkRef]) -> list[ChunkRef]:
        """`missing` with this node's own share first (what the peers wait for), the rest after."""
        if self.config.node_index is None:
            return missing
        num_initial = len(self.config.peers)
        own = [c for c in missing if self._positions[c.key] % num_initial == self.config.node_index]
        return own + [c for c in missing if self._positions[c.key] % num_initial != self.config.node_index]

    def read(self, chunk: ChunkRef) -> bytes:
        position = self._positions[chunk.key]
        holders = self.peers.holders(position)
        if holders:
            return self._from_peer(random.choice(holders).url, chunk)
        owner = owner_of(position, len(self.config.peers), self.peers.live_initial())
        if owner is None or owner == self.config.node_index:
            return self._from_origin(chunk)
        raise NotYetAvailableError(f"chunk {chunk.key}: node {owner} fetches it", retry_after_s=WAIT_FALLBACK_S)

    def chunks_at(self, positions: list[int]) -> list[ChunkRef]:
        return [self._chunks[position] for position in positions]

    def _from_origin(self, chunk: ChunkRef) -> bytes:
        # Not blocking: a thread that would wait for an origin connection takes a peer's chunk
        # instead; the chunk waits in line and the next connection freed calls it back.
        if not self._origin_slots.acquire(blocking=False):
            with self._lock:
                self._origin_waiting.append(chunk)
            raise NotYetAvailableError("every origin connection is busy", retry_after_s=WAIT_FALLBACK_S)
        try:
            data = self.origin.read(chunk)
        finally:
            self._origin_slots.release()
            self._call_next_waiting()
        logger.debug("chunk %s from the origin", chunk.key)
        with self._lock:
            self.stats.origin_bytes += len(data)
            self.stats.origin_chunks += 1
        return data

    def _call_next_waiting(self) -> None:
        """Wake the first chunk in line for the origin that is still missing (one a peer provided
        meanwhile is dropped from the line)."""
        while self.wake is not None:
            with self._lock:
                if not self._origin_waiting:
                    return
                following = self._origin_waiting.popleft()
            if self.wake([following]):
                return

    def _from_peer(self, url: str, chunk: ChunkRef) -> bytes:
        with self._lock:
            source = self._peer_sources.get(url)
            if source is None:
                source = self._peer_sources[url] = HttpSource(url, connections=self.config.peer_connections,
                                                              timeout_s=max(self.config.grace_s, 5.0))  # fmt: skip
        try:
            data = source.read(chunk)
        except NotYetAvailableError:
            raise
        except FetchError as exc:  # the peer, not the chunk, is the problem: ask another without counting a failure
            self.peers.report_failure(url)
            raise NotYetAvailableError(f"chunk {chunk.key} from peer {url}: {exc}",
                                       retry_after_s=self.config.refresh_s / 4) from exc  # fmt: skip
        logger.debug("chunk %s from %s", chunk.key, url)
        with self._lock:
            self.stats.peer_bytes += len(data)
            self.stats.peer_chunks += 1
        return data

    def close(self) -> None:
        with self._lock:
            sources, self._peer_sources = list(self._peer_sources.values()), {}
        for source in sources:
            source.close()


@dataclass
class StoreFiles:
    """The peer server's view of a ChunkStore (a file_server.ServedFiles): only held chunks are
    available (a range touching any other answers 409), the manifest comes from memory."""

    store: ChunkStore

    def __post_init__(self) -> None:
        self._manifest_json = self.store.manifest.to_json().encode()
        self._sizes = {entry.path: entry.size for entry in self.store.manifest.files}

    def manifest_json(self) -> bytes | None:
        return self._manifest_json

    def size(self, path: str) -> int | None:
        return self._sizes.get(path)

    def available(self, path: str, start: int, end: int) -> bool:
        return all(self.store.has(chunk) for chunk in self.store.manifest.chunks_covering(path, start, end))

    def open(self, path: str) -> BinaryIO:
        if path not in self._sizes:
            raise FileNotFoundError(path)
        return (self.store.directory / path).open("rb")


class SwarmNode:
    """One node: its store, its peer server (held bitmap and status routes), its peer table, its source."""

    def __init__(self, origin: ChunkSource, directory: str | Path, config: SwarmConfig) -> None:
        self.config = config
        manifest = origin.fetch_manifest()
        self.store = ChunkStore.open(directory, manifest)
        self._keys = {chunk.key: position for position, chunk in enumerate(manifest.chunks())}
        self._digest = manifest.digest
        host, port = config.bind_address()
        routes: dict[str, ExtraRoute] = {HELD_ROUTE: self._held_route, STATUS_ROUTE: self._status_route}
        self.server = RangeFileServer(StoreFiles(self.store), host, port, extra_routes=routes)
        self.url = config.own_url(self.server.server_port)
        self.peers = PeerTable(self.url, list(config.peers), self._digest, config.grace_s, config.refresh_s,
                               timeout_s=max(1.0, config.grace_s / 2))  # fmt: skip
        resumed = sum(chunk.length for chunk in manifest.chunks() if self.store.has(chunk))
        self.stats = SwarmStats(self.url, config.node_index, manifest.total_bytes, resumed_bytes=resumed)
        self.source = SwarmSource(origin, manifest, self.peers, config, self.stats)

    def _held_route(self, query: dict[str, str]) -> dict[str, object]:
        if query.get("from"):
            self.peers.add(query["from"])  # a node polling us is a peer (a late joiner announces itself so)
        held = [self._keys[key] for key in self.store.held_keys()]
        return {"digest": self._digest, "complete": len(held) == len(self._keys),
                "held": encode_bitmap(held, len(self._keys)), "peers": self.peers.urls()}  # fmt: skip

    def _status_route(self, query: dict[str, str]) -> dict[str, object]:
        return {**asdict(self.stats), "complete": self.store.is_complete(), "digest": self._digest,
                "held_chunks": len(self.store.held_keys()), "chunks": len(self._keys)}  # fmt: skip

    def run(self, max_attempts: int = DEFAULT_MAX_ATTEMPTS, progress: bool = False, stats_path: Path | None = None,
            timeout_s: float | None = None) -> SwarmStats:  # fmt: skip
        """Pull every chunk, then seed; returns the stats (also written to `stats_path`, once on
        completion and again after seeding). Raises what the puller raises."""
        self.stats.started_at = time.time()
        started = time.monotonic()
        self.server.start()
        # A thread per origin and per peer connection: threads waiting on the origin never hold up peer reads.
        connections = self.config.origin_connections + self.config.peer_connections
        puller = Puller(self.source, self.store, connections, max_attempts, progress,
                        order=self.source.order(self.store.missing()))  # fmt: skip
        self.source.wake = puller.wake
        self.peers.on_held = lambda positions: puller.wake(self.source.chunks_at(positions))
        self.peers.on_gone = lambda url: puller.wake(self.store.missing())  # some may be this node's now
        self.peers.start()
        try:
            puller.start()
            puller.wait(timeout_s)
            self.stats.completed_at = time.time()
            self.stats.pull_seconds = time.monotonic() - started
            self._update_stats(stats_path)
            self.stats.seed_seconds = self._seed()
        finally:
            puller.stop()
            self.peers.stop()
            self.server.stop()
            self.source.close()
        self._update_stats(stats_path)
        return self.stats

    def _seed(self) -> float:
        """Serve until every live peer is complete, within [seed_min_s, seed_s]; returns the seconds."""
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < self.config.seed_s:
            if elapsed >= self.config.seed_min_s and self.peers.all_live_complete():
                break
            time.sleep(min(self.config.refresh_s, self.config.seed_s - elapsed))
        return time.monotonic() - started

    def _update_stats(self, stats_path: Path | None) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.stats.cpu_seconds = usage.ru_utime + usage.ru_stime
        self.stats.served_bytes = self.server.bytes_sent
        self.stats.gone_peers = [peer.url for peer in self.peers.snapshot() if peer.gone]
        if stats_path is not None:
            partial = stats_path.with_name(stats_path.name + ".partial")
            partial.write_text(json.dumps(asdict(self.stats), indent=1) + "\n")
            os.replace(partial, stats_path)
