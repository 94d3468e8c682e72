"""What a swarm node knows about its peers: who answers, who is gone, who holds which chunk.

Every peer is polled by a thread of its own (a peer that hangs delays nobody else):

    GET <peer>/_servelm/held?from=<this node's URL>
      {"digest": manifest digest, "complete": bool, "held": base64 bitmap, "peers": [URL, ...]}

The bitmap has one bit per chunk in manifest order (`Manifest.chunks()`), bit i of byte i // 8
for chunk i: 700 GB in 16 MiB chunks is ~44k chunks, a 5.5 KB bitmap, cheap to poll a few
times a second from every peer. `from` announces the caller (a node that joined late becomes
known to the nodes it polls); `peers` passes the URLs a node knows on (gossip), so nodes that
joined late find each other too.

Liveness, two notions on purpose:
- *failing*: the last poll or read failed. A failing peer is not asked for chunks; one good
  poll makes it eligible again.
- *gone*: failing for longer than `grace_s` (a peer that never answered yet: `startup_grace_s`,
  as the nodes of a cluster do not start in the same second). Sticky: the ownership of chunks (swarm.owner_of)
  is a function of the set of gone nodes, and every node must arrive at the same set, so a
  node declared gone is never taken back into it, even if it answers again (its chunks are
  still read from it then).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

from servelm.delivery.swarm_config import normalize_url

logger = logging.getLogger(__name__)

HELD_ROUTE = "held"
STATUS_ROUTE = "status"
COMPLETE_POLL_S = 1.0  # a complete peer's bitmap no longer changes: poll it only to see it leave
GONE_POLL_S = 2.0  # a gone peer is still polled, slowly, in case it comes back to serve


def encode_bitmap(positions: Iterable[int], count: int) -> str:
    """base64 of a bitmap of `count` bits with the bits at `positions` set."""
    bits = bytearray((count + 7) // 8)
    for position in positions:
        bits[position >> 3] |= 1 << (position & 7)
    return base64.b64encode(bytes(bits)).decode()


def bitmap_has(bitmap: bytes, position: int) -> bool:
    byte = position >> 3
    return byte < len(bitmap) and bool(bitmap[byte] >> (position & 7) & 1)


def new_positions(old: bytes, new: bytes) -> list[int]:
    """Positions set in `new` and not in `old` (as little-endian ints, bit i is position i)."""
    added = int.from_bytes(new, "little") & ~int.from_bytes(old, "little")
    positions = []
    while added:
        lowest = added & -added
        positions.append(lowest.bit_length() - 1)
        added ^= lowest
    return positions


@dataclass
class Peer:
    url: str
    index: int | None  # position in the initial list (owns a share of the origin's chunks); None: joined later
    held: bytes = b""  # its bitmap at the last good poll
    complete: bool = False
    failing_since: float | None = None  # start of the current run of failures; None while it answers
    gone: bool = False  # failed for longer than the grace period (sticky, see the module docstring)
    answered: bool = False  # answered at least once


class PeerTable:
    """The peers of one node; thread-safe. `start` begins polling, `stop` ends it."""

    def __init__(
        self,
        self_url: str,
        initial_urls: list[str],
        digest: str,
        grace_s: float = 5.0,
        refresh_s: float = 0.2,
        timeout_s: float = 2.0,
        startup_grace_s: float = 10.0,
    ) -> None:
        self.self_url = normalize_url(self_url)
        self.initial_urls = [normalize_url(url) for url in initial_urls]
        self.self_index = self.initial_urls.index(self.self_url) if self.self_url in self.initial_urls else None
        self.digest = digest
        self.grace_s = grace_s
        self.startup_grace_s = max(grace_s, startup_grace_s)
        self.refresh_s = refresh_s
        self._client = httpx.Client(timeout=timeout_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = False
        self._peers: dict[str, Peer] = {}
        self._threads: list[threading.Thread] = []
        # Listeners (set before `start`), called from poll threads: chunk positions a peer holds
        # now and did not at its last poll; a peer that was declared gone (the ownership changed).
        self.on_held: Callable[[list[int]], object] | None = None
        self.on_gone: Callable[[str], object] | None = None
        for index, url in enumerate(self.initial_urls):
            if url != self.self_url:
                self._peers[url] = Peer(url, index)

    # --- membership ------------------------------------------------------------------------

    def start(self) -> PeerTable:
        with self._lock:
            self._started = True
            peers = list(self._peers.values())
        for peer in peers:
            self._spawn(peer)
        return self

    def add(self, url: str) -> None:
        """A node learned of by announcement or gossip (not an initial one: it owns no share)."""
        url = normalize_url(url)
        with self._lock:
            if url == self.self_url or url in self._peers:
                return
            peer = self._peers[url] = Peer(url, None)
            started = self._started
        logger.info("swarm: %s joined", url)
        if started:
            self._spawn(peer)

    def urls(self) -> list[str]:
        """What this node gossips: itself and the peers answering now (a URL that never answered,
        or stopped, is not passed on)."""
        with self._lock:
            return [self.self_url, *(p.url for p in self._peers.values() if p.answered and p.failing_since is None)]

    def _spawn(self, peer: Peer) -> None:
        thread = threading.Thread(target=self._poll_loop, args=(peer,), name=f"swarm-poll-{peer.url}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in list(self._threads):
            thread.join(timeout=5)
        self._client.close()

    # --- queries (the source's and the seeder's) ------------------------------------------

    def holders(self, position: int) -> list[Peer]:
        """Peers that held chunk `position` at their last poll and are not failing."""
        with self._lock:
            return [p for p in self._peers.values() if p.failing_since is None and bitmap_has(p.held, position)]

    def live_initial(self) -> list[int]:
        """Indices of the initial nodes not gone, in order (this node's included when it is one)."""
        with self._lock:
            gone = {p.index for p in self._peers.values() if p.gone}
        return [index for index in range(len(self.initial_urls)) if index not in gone]

    def all_live_complete(self) -> bool:
        """Every peer that is not gone reports complete (the seeder may stop). A node that joined
        later and never answered yet is left out: it may be a stale URL, and if it is a node, it
        can still read from the origin."""
        with self._lock:
            return all(p.complete for p in self._peers.values() if not p.gone and (p.answered or p.index is not None))

    def snapshot(self) -> list[Peer]:
        with self._lock:
            return [Peer(**vars(p)) for p in self._peers.values()]

    # --- what reads and polls report ------------------------------------------------------

    def report_failure(self, peer: Peer | str) -> None:
        url = peer if isinstance(peer, str) else peer.url
        now = time.monotonic()
        with self._lock:
            state = self._peers.get(url)
            if state is None:
                return
            if state.failing_since is None:
                state.failing_since = now
            grace = self.grace_s if state.answered else self.startup_grace_s
            gone = not state.gone and now - state.failing_since > grace
            if gone:
                state.gone = True
        if gone:
            logger.warning("swarm: %s has not answered for %.1f s: gone, its share is reassigned", url, grace)
            if self.on_gone is not None:
                self.on_gone(url)

    def _answered(self, peer: Peer, held: bytes, complete: bool) -> None:
        with self._lock:
            old, peer.held, peer.complete, peer.answered = peer.held, held, complete, True
            was_failing, peer.failing_since = peer.failing_since is not None, None
        # A peer failing was nobody's holder: what it holds is new to the readers again.
        added = new_positions(b"" if was_failing else old, held)
        if added and self.on_held is not None:
            self.on_held(added)

    def _poll_loop(self, peer: Peer) -> None:
        while not self._stop.is_set():
            self._poll(peer)
            with self._lock:
                pause = GONE_POLL_S if peer.gone else COMPLETE_POLL_S if peer.complete else self.refresh_s
            self._stop.wait(pause)

    def _poll(self, peer: Peer) -> None:
        try:
            response = self._client.get(f"{peer.url}_servelm/{HELD_ROUTE}", params={"from": self.self_url})
            response.raise_for_status()
            answer = response.json()
            held = base64.b64decode(answer["held"])
            complete, known = bool(answer["complete"]), list(answer.get("peers", []))
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            self.report_failure(peer)
            return
        if answer.get("digest") != self.digest:
            if not peer.answered:
                logger.warning("swarm: %s pulls another version (%s): none of its chunks are used",
                               peer.url, str(answer.get("digest"))[:12])  # fmt: skip
            held, complete = b"", True  # nothing to take from it, and nothing to wait for
        self._answered(peer, held, complete)
        for url in known:
            self.add(url)
