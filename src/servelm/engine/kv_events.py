"""KV-cache events out of the engine-core process, for a cache-aware router.

    --kv-events-port P
      tcp://HOST:P      PUB  KVEventBatch after every step that changed the prefix cache or a
                             KV tier, and a heartbeat (no events, same seq) after each idle second
      tcp://HOST:P+1    REP  any request → KVSnapshot (every block hash held, per medium, + the
                             seq it is consistent with)

A router mirrors what each replica can serve without computing, per medium, from the batches.
The wire contract:

- Every record names its medium: "device" (the pool, L1), "host" (L2), "disk" (L3). A block may
  be held in several media at once (the tiers are write-through), and each medium's records
  describe that medium's set alone: STORED / REMOVED of a block in "host" says nothing about the
  pool. CLEARED empties every medium. A record without a medium (an older publisher) is "device".

- `seq` counts non-empty batches of one publisher, from 1, with no holes; a heartbeat
  repeats the last seq. So a subscriber that sees seq > last + 1, or a heartbeat with
  seq > last, lost something (PUB drops on slow joiners and full queues) and must resync.
- `epoch` is random per publisher start: a restarted replica (seq from 1 again) never
  looks like a continuation of the old one.
- A snapshot is taken between steps, after publishing everything drained so far, so
  "the cached sets at seq S" are exact: apply batches with seq > S on top of them. Its
  `block_hashes` is the pool's set, `tier_block_hashes` the other media's.

The hashes are the engine's own block hashes (servelm.kv.block_hash), so a router that
hashes a prompt the same way can look them up directly. The wire types live in
servelm.schemas.kv_events (the router imports those, never this module). Runs in the core
process only; nothing here touches torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import msgspec
import zmq

from servelm.kv.block_pool import KVCacheEvent, KVEventType
from servelm.schemas.kv_events import (
    CLEARED,
    DEVICE,
    REMOVED,
    STORED,
    KVEventBatch,
    KVEventRecord,
    KVSnapshot,
    event_addresses,
)

HEARTBEAT_INTERVAL_S = 1.0


def event_record(event: KVCacheEvent) -> KVEventRecord:
    """The wire record of one pool or tier event (a simulated replica's router reads the same)."""
    kind = STORED if event.type is KVEventType.STORED else REMOVED
    return KVEventRecord(kind, event.block_hash, event.medium.value)


class KVEventPublisher:
    """Publishes the core's KV events; answers snapshot requests. Owned by the core loop alone.

    It keeps its own sets of held hashes per medium, updated from the very events it publishes,
    so a snapshot is exactly the sum of the batches (and needs no access to the pool or tiers).
    Must be created before the engine's first step: it has to see every event.
    """

    def __init__(
        self, context: zmq.Context, host: str, port: int, block_size: int, drain: Callable[[], list[KVCacheEvent]]
    ) -> None:
        """`drain` returns the events recorded since its last call, in order within each medium
        (Scheduler.take_kv_events)."""
        pub_address, snapshot_address = event_addresses(host, port)
        self.block_size = block_size
        self._drain = drain
        self.epoch = os.urandom(8).hex()
        self.seq = 0
        self._held: dict[str, set[bytes]] = {}  # medium → block hashes held there
        self._last_sent = 0.0
        self._encoder = msgspec.msgpack.Encoder()
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(pub_address)
        self.snapshot = context.socket(zmq.REP)
        self.snapshot.bind(snapshot_address)
        # A fresh start says so: a router holding entries from a previous life drops them.
        self._send([KVEventRecord(CLEARED, b"")])

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self.snapshot, zmq.POLLIN)

    def publish(self) -> None:
        """Drain and send one batch (call after each step). No events: a heartbeat, at most once a second."""
        events = self._drain()
        if events:
            records = [event_record(event) for event in events]
            for record in records:
                held = self._held.setdefault(record.medium, set())
                if record.kind == STORED:
                    held.add(record.block_hash)
                else:
                    held.discard(record.block_hash)
            self._send(records)
        elif time.monotonic() - self._last_sent >= HEARTBEAT_INTERVAL_S:
            self._send_batch(self.seq, [])

    def handle(self, ready: dict) -> None:
        """Answer a snapshot request if one is in `ready` (a poll result).

        Undrained events are published first, so the snapshot's seq covers them.
        """
        if self.snapshot not in ready:
            return
        self.snapshot.recv()
        self.publish()
        tiers = {medium: list(held) for medium, held in self._held.items() if medium != DEVICE and held}
        reply = KVSnapshot(
            epoch=self.epoch, seq=self.seq, block_size=self.block_size,
            block_hashes=list(self._held.get(DEVICE, ())), tier_block_hashes=tiers,
        )  # fmt: skip
        self.snapshot.send(self._encoder.encode(reply))

    def close(self) -> None:
        self.pub.close(linger=0)
        self.snapshot.close(linger=0)

    def _send(self, records: list[KVEventRecord]) -> None:
        self.seq += 1
        self._send_batch(self.seq, records)

    def _send_batch(self, seq: int, records: list[KVEventRecord]) -> None:
        batch = KVEventBatch(epoch=self.epoch, seq=seq, timestamp=time.time(), block_size=self.block_size, events=records)
        try:
            self.pub.send(self._encoder.encode(batch), zmq.NOBLOCK)
        except zmq.Again:
            pass  # a subscriber that cannot keep up sees the hole in seq and resyncs
        self._last_sent = time.monotonic()
