"""Shared-memory collectives (servelm.parallel.shm_collectives) on 2 and 3 real ranks: the groups
`ParallelGroups.initialize` makes on one host carry their small collectives through a segment, with
gloo's results (the all-reduce summed in rank order, bitwise the same tensor on every rank; the
all-gathers bitwise gloo's, uneven sizes included), over many consecutive calls (both buffers
reused hundreds of times, peers a call ahead), falling back to gloo for what does not fit. A rank
that skips a call or dies turns the wait into a RuntimeError naming it, never a hang, and the
segment's name is gone from /dev/shm once set up, its mapping once closed.

One spawn per group size runs the result checks (spawning costs more than the collectives).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from servelm.parallel.exchange import all_gather_rows
from servelm.parallel.groups import GroupMember, ParallelGroups, ParallelLayout, all_gather_last_dim, all_reduce_sum
from servelm.parallel.shm_collectives import SHM_DIRECTORY, SharedMemoryGroup
from servelm.testing.ranks import run_ranks

CONSECUTIVE_CALLS = 600
DEADLINE_S = 1.0


def _inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 101 + rank)
    return torch.randn(shape, generator=generator).to(dtype)


def _every_rank(x: torch.Tensor, gloo: GroupMember) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(gloo.size)]
    dist.all_gather(parts, x.contiguous(), group=gloo.group)
    return parts


def _check_results(groups: ParallelGroups) -> dict[str, Any]:
    shm_member = groups.tp
    assert shm_member.shared_memory is not None, "a one-host gloo group gets its segment"
    gloo = GroupMember(shm_member.rank, shm_member.size, shm_member.group)  # the same group, gloo only
    rank, size = shm_member.rank, shm_member.size
    out: dict[str, Any] = {"segment_name_gone": not (SHM_DIRECTORY / shm_member.shared_memory.name).exists()}

    # all-reduce: decode- and prefill-sized float32, bfloat16, an empty tensor, a non-contiguous one
    for case, shape, dtype in [("decode", (1, 576), torch.float32), ("prefill", (512, 576), torch.float32),
                               ("bf16", (3, 576), torch.bfloat16), ("empty", (0, 576), torch.float32)]:  # fmt: skip
        x = _inputs(rank, shape, dtype, seed=len(case))
        by_shm = all_reduce_sum(x.clone(), shm_member)
        by_gloo = all_reduce_sum(x.clone(), gloo)
        parts = _every_rank(x, gloo)
        in_rank_order = parts[0] + parts[1]
        for part in parts[2:]:
            in_rank_order = in_rank_order + part
        out[f"reduce/{case}"] = (by_shm, by_gloo, in_rank_order)
    x = _inputs(rank, (576, 4), torch.float32, seed=9).t()  # [4, 576], not contiguous
    out["reduce/strided"] = (all_reduce_sum(x.clone(), shm_member), all_reduce_sum(x.contiguous(), gloo))

    # too large for a slot: gloo carries it, on every rank alike
    big = _inputs(rank, (shm_member.shared_memory.slot_bytes // 4 + 1,), torch.float32, seed=11)
    out["reduce/too-big"] = (all_reduce_sum(big.clone(), shm_member), all_reduce_sum(big.clone(), gloo))

    # all-gathers with uneven sizes (a vocabulary split unevenly; rows with one rank holding none)
    sizes = [7, 5, 6][:size]
    logits = _inputs(rank, (3, sizes[rank]), torch.float32, seed=13)
    out["gather/last-dim"] = (all_gather_last_dim(logits, shm_member, sizes), all_gather_last_dim(logits, gloo, sizes))
    counts = [4, 0, 2][:size]
    rows = _inputs(rank, (counts[rank], 2, 8), torch.bfloat16, seed=17)
    out["gather/rows"] = (all_gather_rows(rows, shm_member, counts), all_gather_rows(rows, gloo, counts))
    out["gather/ints"] = all_gather_rows(torch.tensor([10 * rank + 1]), shm_member, [1] * size)

    # many consecutive calls: each result is known exactly (small integers in float32)
    wrong = 0
    for call in range(CONSECUTIVE_CALLS):
        value = float(call % 97 + rank)
        if call % 3 == 2:
            widths = [1 + (call + r) % 4 for r in range(size)]
            gathered = all_gather_last_dim(torch.full((2, widths[rank]), value), shm_member, widths)
            expected = torch.cat([torch.full((2, w), float(call % 97 + r)) for r, w in enumerate(widths)], dim=-1)
        else:
            gathered = all_reduce_sum(torch.full((1 + call % 5, 576), value), shm_member)
            expected = torch.full((1 + call % 5, 576), float(size * (call % 97) + sum(range(size))))
        wrong += not torch.equal(gathered, expected)
    out["consecutive_wrong"] = wrong
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def results(request):
    return request.param, run_ranks(_check_results, ParallelLayout(request.param), timeout_s=180)


def test_the_name_is_unlinked_once_every_rank_has_mapped_the_segment(results):
    _, per_rank = results
    assert all(result["segment_name_gone"] for result in per_rank)


@pytest.mark.parametrize("case", ["decode", "prefill", "bf16", "empty"])
def test_all_reduce_is_the_sum_in_rank_order_and_bitwise_the_same_on_every_rank(results, case):
    size, per_rank = results
    by_shm, by_gloo, in_rank_order = per_rank[0][f"reduce/{case}"]
    for result in per_rank:
        assert torch.equal(result[f"reduce/{case}"][0], by_shm)
    assert torch.equal(by_shm, in_rank_order)
    if size == 2:  # a + b == b + a: gloo's order cannot differ
        assert torch.equal(by_shm, by_gloo)
    elif case == "bf16":  # gloo adds in another order: a rounding of a partial sum apart (~|sum| / 128)
        torch.testing.assert_close(by_shm, by_gloo, rtol=2**-7, atol=2**-4)
    else:
        torch.testing.assert_close(by_shm, by_gloo)


def test_a_strided_tensor_and_one_larger_than_a_slot_reduce_as_over_gloo(results):
    size, per_rank = results
    for result in per_rank:
        for case in ("reduce/strided", "reduce/too-big"):
            by_shm, by_gloo = result[case]
            if size == 2:
                assert torch.equal(by_shm, by_gloo), case
            else:
                torch.testing.assert_close(by_shm, by_gloo)


def test_all_gathers_with_uneven_sizes_are_bitwise_gloos(results):
    size, per_rank = results
    for result in per_rank:
        for case in ("gather/last-dim", "gather/rows"):
            by_shm, by_gloo = result[case]
            assert by_shm.dtype == by_gloo.dtype and torch.equal(by_shm, by_gloo), case
        assert result["gather/ints"].tolist() == [10 * r + 1 for r in range(size)]
    assert per_rank[0]["gather/last-dim"][0].shape == (3, sum([7, 5, 6][:size]))


def test_hundreds_of_consecutive_calls_reuse_both_buffers_correctly(results):
    _, per_rank = results
    assert [result["consecutive_wrong"] for result in per_rank] == [0] * len(per_rank)


# -- a rank that skips a call, a rank that dies, closing --------------------------------------


def _failures(groups: ParallelGroups) -> dict[str, Any]:
    group, rank = groups.tp.group, groups.tp.rank
    skipped = SharedMemoryGroup.create(group, timeout_s=DEADLINE_S)
    dead = SharedMemoryGroup.create(group, timeout_s=60.0)
    assert skipped is not None and dead is not None
    if rank == 1:
        time.sleep(3 * DEADLINE_S)  # alive, but never makes the call rank 0 makes
        return {}  # then this process exits: rank 0 is waiting on `dead`
    out: dict[str, Any] = {}
    started = time.monotonic()
    with pytest.raises(RuntimeError) as skip:
        skipped.all_reduce_sum_(torch.ones(4))
    out["skip"] = (str(skip.value), time.monotonic() - started)
    with pytest.raises(RuntimeError) as again:
        skipped.all_reduce_sum_(torch.ones(4))
    out["again"] = str(again.value)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as gone:
        dead.all_reduce_sum_(torch.ones(4))
    out["gone"] = (str(gone.value), time.monotonic() - started)
    return out


def test_a_rank_that_skips_a_call_or_dies_is_named_in_an_error_not_a_hang():
    result = run_ranks(_failures, ParallelLayout(2), timeout_s=120)[0]
    message, waited = result["skip"]
    assert "waited for rank 1" in message and f"did not arrive within {DEADLINE_S:g} s" in message
    assert DEADLINE_S <= waited < DEADLINE_S + 1.0
    assert result["again"] == message  # out of step for good: later calls fail at once
    message, waited = result["gone"]
    assert "waited for rank 1" in message and "is gone" in message
    assert waited < 3 * DEADLINE_S + 5.0, "a dead peer is noticed long before the 60 s deadline"


def _lifetime(groups: ParallelGroups) -> dict[str, Any]:
    shm = groups.tp.shared_memory
    assert shm is not None
    mapped = shm.name in Path("/proc/self/maps").read_text()
    groups.close()
    unmapped = shm.name not in Path("/proc/self/maps").read_text()
    unmade = SharedMemoryGroup.create(groups.tp.group, timeout_s=10.0, slot_bytes=1 << 50)  # /dev/shm cannot hold it
    creator_pid = shm.name.split("-")[2]  # servelm-shm-<pid>-<random>: group rank 0 made both
    leftovers = [path.name for path in SHM_DIRECTORY.glob(f"servelm-shm-{creator_pid}-*")]
    return {"name": shm.name, "mapped": mapped, "unmapped": unmapped, "closed": shm.closed,
            "unmade": unmade is None, "leftovers": leftovers}  # fmt: skip


def test_close_unmaps_the_segment_and_a_failed_set_up_leaves_nothing_in_dev_shm():
    per_rank = run_ranks(_lifetime, ParallelLayout(2), timeout_s=120)
    for result in per_rank:
        assert result["mapped"] and result["unmapped"] and result["closed"]
        assert result["unmade"], "every rank falls back to gloo when the segment cannot be made"
        assert result["leftovers"] == []
        assert not (SHM_DIRECTORY / result["name"]).exists()
