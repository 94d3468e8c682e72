"""One SUB socket per replica feeding the KVIndex, with snapshot resync on any loss.

    replica core ──PUB KVEventBatch──▶ subscriber task ──apply_batch──▶ KVIndex
                 ◀─REQ── snapshot ────┘ (on a hole / new epoch / heartbeat ahead)

Runs on the router's event loop (zmq.asyncio). Start with `start()`, stop with `stop()`
(idempotent). A snapshot that cannot be fetched (replica down) leaves the replica unsynced
(it matches nothing) and is retried on the next batch or heartbeat, at most once a second.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq
import zmq.asyncio

from servelm.router.background import BackgroundTask
from servelm.router.kv_index import KVIndex
from servelm.schemas.kv_events import KVEventBatch, KVSnapshot

logger = logging.getLogger(__name__)
SNAPSHOT_TIMEOUT_S = 5.0
MIN_RESYNC_INTERVAL_S = 1.0


async def fetch_snapshot(context: zmq.asyncio.Context, address: str, timeout_s: float = SNAPSHOT_TIMEOUT_S) -> KVSnapshot:
    """Ask a replica's snapshot socket for its cached set. A fresh REQ each time: a timed-out
    REQ socket is stuck in its send/recv state machine, so it is thrown away."""
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address)
        await socket.send(b"snapshot")
        if not await socket.poll(int(timeout_s * 1000)):  # POLLIN is poll's default
            raise TimeoutError(f"no KV snapshot from {address} in {timeout_s:.0f} s")
        return msgspec.msgpack.decode(await socket.recv(), type=KVSnapshot)
    finally:
        socket.close()


class KVSubscriber:
    def __init__(
        self, context: zmq.asyncio.Context, url: str, events_address: str, snapshot_address: str, index: KVIndex
    ) -> None:
        self.url = url  # the replica's key in the index
        self.events_address = events_address
        self.snapshot_address = snapshot_address
        self.index = index
        self._context = context
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._task = BackgroundTask(f"kv-sub {self.url}", self._run)
        self._last_resync = 0.0
        self.num_batches = 0

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def resync(self) -> bool:
        """Replace the replica's entries with a fresh snapshot; False (entries stay dropped) if unreachable."""
        self._last_resync = time.monotonic()
        try:
            snapshot = await fetch_snapshot(self._context, self.snapshot_address)
        except (TimeoutError, zmq.ZMQError, msgspec.DecodeError) as error:
            logger.warning("KV snapshot from %s failed: %s", self.url, error)
            return False
        self.index.apply_snapshot(self.url, snapshot)
        tiers = {medium: len(hashes) for medium, hashes in snapshot.tier_block_hashes.items()}
        logger.info(
            "KV index for %s resynced at seq %d: %d pool blocks, tiers %s",
            self.url, snapshot.seq, len(snapshot.block_hashes), tiers,
        )  # fmt: skip
        return True

    async def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.events_address)
        try:
            await self.resync()
            while True:
                batch = self._decoder.decode(await sub.recv())
                self.num_batches += 1
                if self.index.apply_batch(self.url, batch) and time.monotonic() - self._last_resync >= MIN_RESYNC_INTERVAL_S:
                    await self.resync()
        finally:
            sub.close()
