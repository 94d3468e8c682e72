"""Context parallelism end to end: the step plan, then a tiny Llama on 2 real ranks against 1.

The plan (no processes): every rank's tokens partition the batch, the K/V slots follow the
token-interleaved layout written out by hand, and the per-request choice between gathering
queries and the ring follows the bytes (the ring's weighed by RING_BYTES_WEIGHT, from a measurement).

The model: the same script of steps — a prefix cached by an earlier request, a prompt after it
in chunks of 10, 18, 4 and 1 tokens (the last gives one rank no token), a fresh prompt joining
mid-way, decodes, a lone decode at the end — runs on one rank with the plain torch backend
(logical blocks of 8) and on 2 CP ranks (physical blocks of 4, same block ids). Every step's
logits agree within float32 tolerance and the greedy tokens are identical, with each strategy
forced and chosen per request, with an int8 KV pool, and with every part through torch's CPU
flash kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from servelm.attention.backend import CommonAttentionInputs
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.parallel import partial_attention
from servelm.parallel.context_backend import ContextParallelBackend, ContextParallelMetadata
from servelm.parallel.context_layout import AttentionHeads, Strategy, plan_step
from servelm.parallel.groups import GroupMember, ParallelGroups, ParallelLayout
from servelm.testing.ranks import run_ranks
from servelm.worker.kv_cache import allocate_kv_caches
from servelm.worker.paged_inputs import paged_attention_inputs

HEADS = AttentionHeads(num_heads=4, num_kv_heads=2, head_dim=16)  # the tiny model's

# -- the plan ----------------------------------------------------------------------------


def _common(requests: list[tuple[int, int]], block_size: int, seed: int = 0) -> CommonAttentionInputs:
    """(query_len, seq_len) per request over a scattered block table of logical blocks."""
    gen = torch.Generator().manual_seed(seed)
    width = max((s + block_size - 1) // block_size for _, s in requests)
    table = torch.randperm(len(requests) * width, generator=gen).view(len(requests), width).int()
    rows = torch.arange(len(requests))
    num_computed = torch.tensor([s - q for q, s in requests])
    query_lens = torch.tensor([q for q, _ in requests])
    _, common = paged_attention_inputs(
        table, rows, num_computed, query_lens, block_size, torch.device("cpu"), torch.float32, torch.float32
    )
    return common


@pytest.mark.parametrize("cp_size,physical_block", [(2, 4), (3, 2), (4, 1)])
def test_plan_partitions_the_batch_and_follows_the_layout(cp_size, physical_block):
    requests = [(1, 30), (9, 9), (5, 41), (1, 1), (17, 20)]
    logical = physical_block * cp_size
    common = _common(requests, logical, seed=cp_size)
    positions = torch.cat([torch.arange(s - q, s) for q, s in requests])
    request_of = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor([q for q, _ in requests]))
    plans = [plan_step(common, r, cp_size, HEADS, Strategy.AUTO) for r in range(cp_size)]
    covered = torch.cat([p.local_token_index for p in plans])
    assert sorted(covered.tolist()) == list(range(common.num_tokens))
    assert torch.equal(plans[0].gathered_token_index, covered)
    for rank, plan in enumerate(plans):
        rows = plan.local_token_index
        assert bool((positions[rows] % cp_size == rank).all())
        assert plan.tokens_per_rank == [p.local_token_index.numel() for p in plans]
        # The brief's formula: block table[row, p // (B * C)] at offset (p % (B * C)) // C.
        p = positions[rows]
        blocks = common.block_table[request_of[rows], p // logical].long()
        assert torch.equal(plan.local_slots, blocks * physical_block + (p % logical) // cp_size)


def test_the_choice_follows_the_measured_bytes():
    # A fresh long prompt, a decode, a short chunk after long context, a long chunk after short
    # context, a longer chunk after long context.
    common = _common([(512, 512), (1, 900), (8, 1000), (500, 600), (40, 2000)], 8)
    plan = plan_step(common, 0, 2, HEADS, Strategy.AUTO)
    assert plan.ring is not None and plan.gather is not None
    assert len(plan.ring.requests) == 2  # requests 0 and 3
    assert plan.ring.shard_lens == [256 + 300, 256 + 300]
    assert sum(plan.gather.counts) == 1 + 8 + 40  # the decode, the short chunk and the longer one
    # The decode and the short chunk side by side; the longer chunk alone, its queries from each rank
    # one run of rows (rank 0's block: the short chunk's 4, then its 20; rank 1's: the decode, 4, 20):
    # positions 1960, 1962, ... and 1961, 1963, ... see 981, 982, ... of rank 0's 1000 keys.
    assert [g.queries.shape for g in plan.gather.groups] == [(2, 8)]
    (chunk,) = plan.gather.chunks
    assert chunk.slots.numel() == 1000 and chunk.parts == ((4, 24, 981), (29, 49, 981))
    forced = plan_step(common, 0, 2, HEADS, Strategy.GATHER)
    assert forced.ring is None and sum(forced.gather.counts) == common.num_tokens


def test_inconsistent_layouts_raise():
    with pytest.raises(ValueError, match="multiple of cp size"):
        plan_step(_common([(3, 9)], 6), 0, 4, HEADS, Strategy.AUTO)
    no_pool = CommonAttentionInputs.for_prompts([5, 3])
    assert plan_step(no_pool, 1, 2, HEADS, Strategy.AUTO).ring is not None  # whole prompts: on the ring
    with pytest.raises(ValueError, match="without a KV pool"):
        plan_step(no_pool, 1, 2, HEADS, Strategy.GATHER)


# -- the model on real ranks ------------------------------------------------------------

CP_SIZE, PHYSICAL_BLOCK = 2, 4
LOGICAL_BLOCK = PHYSICAL_BLOCK * CP_SIZE
NUM_BLOCKS = 16
# Logical block ids per request; A and B share blocks 5 and 2: B's first 16 tokens are A's prompt.
TABLE = torch.tensor(
    [[5, 2, 11, 3, 0, 0, 0, 0], [5, 2, 7, 1, 4, 9, 10, 6], [8, 12, 13, 0, 0, 0, 0, 0]], dtype=torch.int32
)
A, B, C = 0, 1, 2
# New tokens per request, step by step. B starts with its first 16 tokens cached (a prefix hit).
SCRIPT: list[dict[int, int]] = [
    {A: 16},
    {B: 10, A: 1},
    {B: 18, A: 1, C: 9},  # C: a fresh prompt among a chunk (long enough to be gathered alone) and a decode
    {B: 4, A: 1, C: 1},
    {B: 1},  # the prompt's last token alone: one rank computes no token
    *[{A: 1, B: 1, C: 1}] * 5,
    {B: 1},  # a lone decode
]


def _prompts() -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, 49152, (16,), generator=gen).tolist()
    return {
        A: prefix,
        B: prefix + torch.randint(0, 49152, (33,), generator=gen).tolist(),
        C: torch.randint(0, 49152, (9,), generator=gen).tolist(),
    }


@dataclass
class ScriptRun:
    logits: list[torch.Tensor]  # per step [T, V]
    tokens: dict[int, list[int]]  # each request's tokens at the end (prompt + greedy)
    plans: list[tuple[int, bool, bool]]  # per step (T_local, gathers, rings); empty for one rank


def _run_script(forward: Callable[[CommonAttentionInputs, torch.Tensor, torch.Tensor], torch.Tensor],
                kv_dtype: torch.dtype) -> ScriptRun:  # fmt: skip
    """Drive SCRIPT through `forward(common, input_ids, positions) -> logits [T, V]`; greedy tokens."""
    tokens = _prompts()
    num_computed = {A: 0, B: 16, C: 0}
    logits_per_step = []
    for step in SCRIPT:
        requests = list(step)
        nc = torch.tensor([num_computed[r] for r in requests])
        ql = torch.tensor([step[r] for r in requests])
        ids = torch.tensor([t for r in requests for t in tokens[r][num_computed[r] : num_computed[r] + step[r]]])
        positions, common = paged_attention_inputs(
            TABLE, torch.tensor(requests), nc, ql, LOGICAL_BLOCK, torch.device("cpu"), torch.float32, kv_dtype
        )
        logits = forward(common, ids, positions)
        logits_per_step.append(logits)
        ends = torch.cumsum(ql, 0).tolist()
        for r, end in zip(requests, ends):
            num_computed[r] += step[r]
            if num_computed[r] == len(tokens[r]):  # caught up: the last row's logits give a token
                tokens[r].append(int(logits[end - 1].argmax()))
    return ScriptRun(logits_per_step, tokens, [])


def _single_rank_run(tiny_dir, kv_dtype: torch.dtype) -> ScriptRun:
    checkpoint = load_checkpoint(tiny_dir)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu")
    backend = model.decoder_layers[0].self_attn.backend
    pools = allocate_kv_caches(checkpoint.arch, NUM_BLOCKS, LOGICAL_BLOCK, kv_dtype, torch.device("cpu"))

    def forward(common, ids, positions):
        return model.compute_logits(model(ids, positions, backend.build_metadata(common), pools))

    return _run_script(forward, kv_dtype)


def _cp_run(cp: GroupMember, tiny_dir, strategy: Strategy, kv_dtype: torch.dtype) -> ScriptRun:
    checkpoint = load_checkpoint(tiny_dir)
    backend = ContextParallelBackend(cp, HEADS, strategy)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu", attention_backend=backend)
    pools = allocate_kv_caches(checkpoint.arch, NUM_BLOCKS, PHYSICAL_BLOCK, kv_dtype, torch.device("cpu"))
    plans = []

    def forward(common, ids, positions):
        metadata = backend.build_metadata(common)
        assert isinstance(metadata, ContextParallelMetadata)
        rows = metadata.local_token_index
        plans.append((rows.numel(), metadata.plan.gather is not None, metadata.plan.ring is not None))
        hidden = backend.gather_hidden(model(ids[rows], positions[rows], metadata, pools), metadata)
        return model.compute_logits(hidden)

    run = _run_script(forward, kv_dtype)
    run.plans = plans
    return run


# (strategy, KV pool dtype, whether every part goes through torch's CPU flash kernel: the script's
# chunks are too short for it otherwise)
CASES = [(Strategy.AUTO, torch.float32, False), (Strategy.RING, torch.float32, False),
         (Strategy.GATHER, torch.float32, False), (Strategy.AUTO, torch.int8, False),
         (Strategy.AUTO, torch.float32, True)]  # fmt: skip


def _cp_rank(groups: ParallelGroups, tiny_dir) -> list[ScriptRun]:
    runs = []
    default = partial_attention.FLASH_MIN_QUERIES
    for strategy, kv_dtype, flash in CASES:
        partial_attention.FLASH_MIN_QUERIES = 1 if flash else default  # this rank process's own module
        runs.append(_cp_run(groups.cp, tiny_dir, strategy, kv_dtype))
    return runs


@pytest.fixture(scope="module")
def cp_runs(tiny_dir):
    return run_ranks(_cp_rank, ParallelLayout(context_parallel_size=CP_SIZE), args=(tiny_dir,), timeout_s=180)


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=[f"{s.value}-{str(d)[6:]}{'-flash' if f else ''}" for s, d, f in CASES]
)
def test_two_ranks_equal_one_rank(tiny_dir, cp_runs, case):
    strategy, kv_dtype, _ = CASES[case]
    reference = _single_rank_run(tiny_dir, kv_dtype)
    for rank_runs in cp_runs:
        run = rank_runs[case]
        assert run.tokens == reference.tokens  # identical greedy tokens
        for step, (got, want) in enumerate(zip(run.logits, reference.logits)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
    plans = [rank_runs[case].plans for rank_runs in cp_runs]
    lone = [len(SCRIPT) - 1, 4]  # a lone decode, the prompt's one-token last chunk: one rank idles
    for step in lone:
        assert sorted(p[step][0] for p in plans) == [0, 1]
    if strategy is Strategy.AUTO:
        assert plans[0][0][1:] == (False, True)  # a fresh prompt alone: the ring
        assert plans[0][2][1:] == (True, True)  # decodes and chunks gathered, the fresh prompt on the ring
