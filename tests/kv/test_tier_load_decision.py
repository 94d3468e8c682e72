"""Load or compute: KVTiers.worth_loading weighs a block's bytes over each tier's bandwidth (the
assumed one until loads measure it) against the step-cost model's price of computing that block
(its tokens and its attention pairs at its depth), unless the policy is to load whatever is found."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.config import KVTierConfig
from servelm.datatypes import KVMedium
from servelm.kv.disk_store import DiskBlockStore
from servelm.kv.tiers import INITIAL_BANDWIDTH, KVTiers

BLOCK_SIZE = 16
BLOCK_BYTES = 1 << 20  # 1 MiB: the host tier loads it in ~0.26 ms, the disk tier in ~1 ms (assumed)


def _tiers(tmp_path: Path, policy: str = "cost") -> KVTiers:
    config = KVTierConfig(host_bytes=64 * BLOCK_BYTES, disk_path=str(tmp_path), kv_load_policy=policy)
    return KVTiers(config, BLOCK_SIZE, BLOCK_BYTES, disk_store=DiskBlockStore(tmp_path, "fingerprint"))


def test_without_a_prefill_estimate_every_found_block_is_loaded(tmp_path):
    media = [KVMedium.HOST, KVMedium.DISK, KVMedium.DISK]
    assert _tiers(tmp_path).worth_loading(media, None) == 3


def test_blocks_load_while_their_tier_is_faster_than_computing_and_stop_at_the_first_slower_tier(tmp_path):
    tiers = _tiers(tmp_path)
    host_s = BLOCK_BYTES / INITIAL_BANDWIDTH[KVMedium.HOST]
    disk_s = BLOCK_BYTES / INITIAL_BANDWIDTH[KVMedium.DISK]
    media = [KVMedium.HOST, KVMedium.HOST, KVMedium.DISK, KVMedium.HOST]
    # Computing a block costs more than reading it from either tier: load all four.
    assert tiers.worth_loading(media, [2 * disk_s] * 4) == 4
    # Between the two: the host blocks before the first disk block load; the rest is computed
    # (a load is one ordered run of leading blocks, so the host block after the disk one is not).
    assert tiers.worth_loading(media, [(host_s + disk_s) / 2] * 4) == 2
    # Computing is cheaper than either tier: nothing loads.
    assert tiers.worth_loading(media, [host_s / 2] * 4) == 0


def test_a_block_deep_enough_in_its_prompt_is_worth_reading_from_disk(tmp_path):
    # Each block costs more to compute than the one before it (its attention pairs grow with its
    # depth): disk blocks that start cheaper to compute than to read load once computing costs more.
    tiers = _tiers(tmp_path)
    disk_s = BLOCK_BYTES / INITIAL_BANDWIDTH[KVMedium.DISK]
    media = [KVMedium.DISK] * 3
    assert tiers.worth_loading(media, [disk_s / 2, disk_s / 1.5, 2 * disk_s]) == 0  # stops at the first
    assert tiers.worth_loading(media, [1.5 * disk_s, 2 * disk_s, 3 * disk_s]) == 3


def test_the_always_policy_loads_every_block_found_however_cheap_computing_is(tmp_path):
    media = [KVMedium.HOST, KVMedium.DISK, KVMedium.DISK]
    assert _tiers(tmp_path, "always").worth_loading(media, [1e-12] * 3) == 3
    assert _tiers(tmp_path, "cost").worth_loading(media, [1e-12] * 3) == 0


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="kv_load_policy"):
        KVTierConfig(host_bytes=1, kv_load_policy="sometimes")
