"""Load or compute: KVTiers.worth_loading weighs a block's bytes over each tier's bandwidth (the
assumed one until loads measure it) against the step-cost model's prefill time for a block."""

from __future__ import annotations

from pathlib import Path

from servelm.config import KVTierConfig
from servelm.datatypes import KVMedium
from servelm.kv.disk_store import DiskBlockStore
from servelm.kv.tiers import INITIAL_BANDWIDTH, KVTiers

BLOCK_SIZE = 16
BLOCK_BYTES = 1 << 20  # 1 MiB: the host tier loads it in ~0.26 ms, the disk tier in ~1 ms (assumed)


def _tiers(tmp_path: Path) -> KVTiers:
    config = KVTierConfig(host_bytes=64 * BLOCK_BYTES, disk_path=str(tmp_path))
    return KVTiers(config, BLOCK_SIZE, BLOCK_BYTES, disk_store=DiskBlockStore(tmp_path, "fingerprint"))


def _per_token_cost_of(seconds_per_block: float) -> float:
    return seconds_per_block / BLOCK_SIZE


def test_without_a_prefill_estimate_every_found_block_is_loaded(tmp_path):
    media = [KVMedium.HOST, KVMedium.DISK, KVMedium.DISK]
    assert _tiers(tmp_path).worth_loading(media, None) == 3


def test_blocks_load_while_their_tier_is_faster_than_computing_and_stop_at_the_first_slower_tier(tmp_path):
    tiers = _tiers(tmp_path)
    host_s = BLOCK_BYTES / INITIAL_BANDWIDTH[KVMedium.HOST]
    disk_s = BLOCK_BYTES / INITIAL_BANDWIDTH[KVMedium.DISK]
    media = [KVMedium.HOST, KVMedium.HOST, KVMedium.DISK, KVMedium.HOST]
    # Computing a block costs more than reading it from either tier: load all four.
    assert tiers.worth_loading(media, _per_token_cost_of(2 * disk_s)) == 4
    # Between the two: the host blocks before the first disk block load; the rest is computed
    # (a load is one ordered run of leading blocks, so the host block after the disk one is not).
    assert tiers.worth_loading(media, _per_token_cost_of((host_s + disk_s) / 2)) == 2
    # Computing is cheaper than either tier: nothing loads.
    assert tiers.worth_loading(media, _per_token_cost_of(host_s / 2)) == 0
