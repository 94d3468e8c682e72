"""The producer's exports: which transfers a pull may be served, and what to do with a block that
is not in the host store yet. Plain Python, thread-safe (no torch: the host store is reached
through `lookup`).

Life of an export (the scheduler's orders, KVTransfers.exports / export_ends, applied by the
producer's runner; the transfer server reads it from its own thread):

    announce ──▶ OPEN ──end(COMPLETE)──▶ COMPLETE ──┐
                   └───end(ABORTED)───▶ ABORTED  ──┴─end(EXPIRED)──▶ forgotten (pulls fail "expired")
                   └───────────────────end(EXPIRED)─────────────────▶

What a pull's next block is (`next_block`): in the store → send it; absent while the export is
OPEN → wait (the prefill has not computed it yet); absent once the export is COMPLETE or
ABORTED, or a hash the export never announced → "missing" (no one will save it).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from servelm.datatypes import KVExportEnd
from servelm.disagg.protocol import PullFailure

# Expired transfer ids remembered (so their late pulls fail "expired" at once, not "unknown" after
# wait_s); the oldest are forgotten beyond this.
MAX_REMEMBERED_EXPIRED = 4096


class _State(enum.Enum):
    OPEN = "open"  # the prefill is computing: absent blocks will come
    ENDED = "ended"  # complete or aborted: absent blocks never will


@dataclass
class _Export:
    block_hashes: frozenset[bytes]
    state: _State = _State.OPEN


class ExportRegistry:
    """Announced transfers of one producer.

    Writers: the producer's runner thread (`announce`, `end`, `notify_saved` after the host store
    gained blocks, `take_served`). Reader: the transfer server's thread (`next_block`,
    `mark_served`). Every method is thread-safe; listeners (`add_listener`) run after any change
    that may let a waiting pull advance, on the changing thread, outside the registry's lock.
    """

    def __init__(self, lookup: Callable[[bytes], memoryview | None], wait_s: float) -> None:
        """`lookup(block_hash)`: the host store's payload of that block, None if absent; called
        from the server's thread. `wait_s`: how long a pull of a transfer not yet announced waits
        for its announcement before failing "unknown"."""
        if wait_s <= 0:
            raise ValueError(f"wait_s must be positive, got {wait_s}")
        self._lookup = lookup
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._exports: dict[str, _Export] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._served: list[str] = []
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every announce, end and notify_saved (the server wakes on it)."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        """Stop calling `listener` (a closing server); safe if it was never added."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    # -- the scheduler's orders (the producer's runner thread) -------------------------------

    def announce(self, transfer_id: str, block_hashes: Sequence[bytes]) -> None:
        """Blocks `block_hashes` of `transfer_id` will be saved as the prefill computes them.
        Repeating it for an open or ended transfer changes nothing; an expired id starts afresh."""
        if not transfer_id:
            raise ValueError("transfer_id must be a non-empty string")
        with self._lock:
            self._expired.pop(transfer_id, None)
            if transfer_id not in self._exports:
                self._exports[transfer_id] = _Export(frozenset(block_hashes))
        self._notify()

    def end(self, transfer_id: str, why: KVExportEnd) -> None:
        """COMPLETE (every block that will be saved has been) or ABORTED: blocks absent from the
        store are missing from now on. EXPIRED: forget the transfer; its pulls fail at once.
        Ending a transfer never announced records only an EXPIRED; safe to repeat."""
        with self._lock:
            if why is KVExportEnd.EXPIRED:
                self._exports.pop(transfer_id, None)
                self._expired[transfer_id] = None
                self._expired.move_to_end(transfer_id)
                while len(self._expired) > MAX_REMEMBERED_EXPIRED:
                    self._expired.popitem(last=False)
            elif (export := self._exports.get(transfer_id)) is not None:
                export.state = _State.ENDED
        self._notify()

    def notify_saved(self) -> None:
        """The host store gained blocks: wake the pulls waiting for them."""
        self._notify()

    def take_served(self) -> list[str]:
        """Transfers a pull was sent every block it asked for since the last call, each once per
        pull (the scheduler may release their blocks early). For a pull of every announced block
        that is: all of the transfer's blocks were sent."""
        with self._lock:
            served, self._served = self._served, []
        return served

    # -- the transfer server's side -----------------------------------------------------------

    def next_block(self, transfer_id: str, block_hash: bytes, pull_arrived: float) -> memoryview | PullFailure | None:
        """What to do for a pull's next block: its payload (send it), None (wait: it is being
        computed, or the transfer may still be announced), or why the pull fails.
        `pull_arrived`: time.monotonic() when the pull arrived (an unknown transfer waits wait_s)."""
        with self._lock:
            export = self._exports.get(transfer_id)
            if export is None:
                if transfer_id in self._expired:
                    return PullFailure.EXPIRED
                return PullFailure.UNKNOWN if time.monotonic() - pull_arrived >= self.wait_s else None
            state, announced = export.state, block_hash in export.block_hashes
        # The lookup runs outside the lock: it takes the host store's own lock.
        payload = self._lookup(block_hash)
        if payload is not None:
            return payload
        if state is _State.OPEN and announced:
            # A save may have landed (and its notify_saved passed) between the lookup and here: the
            # caller asks again on the next wake-up or heartbeat, so nothing is lost.
            return None
        return PullFailure.MISSING

    def mark_served(self, transfer_id: str) -> None:
        """A pull of `transfer_id` was sent its last block (see take_served)."""
        with self._lock:
            if transfer_id in self._exports:
                self._served.append(transfer_id)

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
