"""The producer's host tier as the export registry sees it (hash → payload), a consumer's callbacks
that record what arrived, and blocks the size of the default model's (SmolLM2-135M: 30 layers x
K,V x 16 tokens x 3 KV heads x 64 dims x fp32 = 737,280 bytes)."""

from __future__ import annotations

import hashlib
import random
import threading
import time

from servelm.disagg.exports import ExportRegistry

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4


def block_hash(transfer_id: str, index: int) -> bytes:
    return hashlib.sha256(f"{transfer_id}/{index}".encode()).digest()


def block_payload(transfer_id: str, index: int) -> bytes:
    return random.Random(f"{transfer_id}/{index}").randbytes(BLOCK_BYTES)


class HostStore:
    """Payloads by block hash, saved from the test's thread and read by the server's (as the
    KVOffloader's host tier is); `save` then wakes the registry's waiting pulls."""

    def __init__(self) -> None:
        self._blocks: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self.registry: ExportRegistry | None = None

    def lookup(self, block_hash: bytes) -> memoryview | None:
        with self._lock:
            payload = self._blocks.get(block_hash)
        return None if payload is None else memoryview(payload)

    def save(self, transfer_id: str, indices) -> None:
        with self._lock:
            for index in indices:
                self._blocks[block_hash(transfer_id, index)] = block_payload(transfer_id, index)
        assert self.registry is not None
        self.registry.notify_saved()


class Received:
    """A consumer's on_block / on_end: what arrived, in order, per pull key."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[tuple[int, bytes]]] = {}
        self.ends: dict[str, list[str | None]] = {}
        self._changed = threading.Condition()

    def on_block(self, key: str, index: int, payload: memoryview) -> None:
        with self._changed:
            self.blocks.setdefault(key, []).append((index, bytes(payload)))
            self._changed.notify_all()

    def on_end(self, key: str, failure: str | None) -> None:
        with self._changed:
            self.ends.setdefault(key, []).append(failure)
            self._changed.notify_all()

    def wait_blocks(self, key: str, count: int, timeout_s: float = 5.0) -> list[int]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.blocks.get(key, [])) >= count, timeout_s), (
                f"{key}: {len(self.blocks.get(key, []))} of {count} blocks arrived"
            )
            return [index for index, _ in self.blocks[key]]

    def wait_end(self, key: str, timeout_s: float = 5.0) -> str | None:
        with self._changed:
            assert self._changed.wait_for(lambda: key in self.ends, timeout_s), f"{key} did not end"
            return self.ends[key][0]

    def indices(self, key: str) -> list[int]:
        with self._changed:
            return [index for index, _ in self.blocks.get(key, [])]

    def check_payloads(self, key: str, transfer_id: str) -> None:
        with self._changed:
            for index, payload in self.blocks.get(key, []):
                assert payload == block_payload(transfer_id, index), f"{key}: block {index} differs"


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
