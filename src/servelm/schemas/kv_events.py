"""KV-cache event wire types: what an engine core publishes and a router subscribes to.

The contract (seq, epoch, heartbeats, snapshots) is stated in servelm.engine.kv_events, the
publisher. A `block_hash` is the engine's own block hash (servelm.kv.block_hash).
"""

from __future__ import annotations

import msgspec

# Record kinds; "cleared" means every block this replica had is gone (a restart sends it first).
STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"

# Media, nearest first: the values of servelm.datatypes.KVMedium (the pool, host memory, a disk
# directory), as vLLM's events name a block's medium. A subscriber mirrors any medium it is sent.
DEVICE = "device"
HOST = "host"
DISK = "disk"


class KVEventRecord(msgspec.Struct, array_like=True):
    kind: str  # STORED | REMOVED | CLEARED
    block_hash: bytes  # b"" for CLEARED
    medium: str = DEVICE  # where the block is (un)stored; a record from before tiers decodes as the pool's


class KVEventBatch(msgspec.Struct, kw_only=True):
    epoch: str  # random per publisher start
    seq: int  # 1, 2, ... per non-empty batch; a heartbeat repeats the last one
    timestamp: float
    block_size: int
    events: list[KVEventRecord]


class KVSnapshot(msgspec.Struct, kw_only=True):
    epoch: str
    seq: int  # the cached sets below are the result of batches 1..seq
    block_size: int
    block_hashes: list[bytes]  # the pool's (DEVICE)
    tier_block_hashes: dict[str, list[bytes]] = {}  # medium (HOST, DISK) → what that tier holds


def event_addresses(host: str, port: int) -> tuple[str, str]:
    """(PUB address, snapshot address) for a replica started with --kv-events-port `port`."""
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"
