"""Where a request's tokens and K/V live under context parallelism (C ranks), and one step's plan.

Token interleaving: global position p of a request lives on rank p % C, at local index p // C.

    positions   0  1  2  3  4  5  6  7  8  9 10 11 ...     (C = 2, physical block size B = 2)
    rank        0  1  0  1  0  1  0  1  0  1  0  1
    local j     0  0  1  1  2  2  3  3  4  4  5  5
    logical block 0 = positions 0..3 ─▶ physical block 0 on each rank holds local 0..1

The scheduler's blocks are logical blocks of B * C positions; every rank's pool has physical
blocks of B slots with the same ids, so a request's K/V on rank r is an ordinary paged sequence
of block size B over the same block table: local index j sits in block table[j // B] at offset
j % B. Rank r holds rank_count(n, r) = ceil((n - r) / C) of a request's first n positions, and a
query at position P sees the rank's local keys j < rank_count(P + 1, r) (none when P < r).

Each rank computes the new tokens of the step that live on it (every C-th token of a chunk: the
linear layers' work is balanced by construction) and attends their queries to every rank's keys,
one of two ways per request (`plan_step`):

- gather: all-gather the queries, every rank attends all of them to its own pool and returns
  each partial (output + log-sum-exp) to the query's rank by all-to-all; per rank it receives
  ~ q_len * (2 H D + H) values. Decodes, and short chunks after long cached context.
- ring: K/V shards travel around the ranks (servelm.parallel.ring); per rank it receives
  ~ seq_len * 2 KVH D values. Long chunks with little context (a fresh prompt).

`plan_step` picks the fewer bytes, and is pure: every rank plans the same step from the same
global inputs, so the ranks agree on every count and every collective without a message.
Measured (benchmarks/context_parallel.py: 2 CPU ranks over gloo loopback, SmolLM2-135M's heads,
fp32), the ring is faster from q / seq_len ~ 0.19 on, at 4k and 8k alike, where the bytes say
0.32: its next shard moves while this one is attended, the gather's two collectives block. In
between the two are within 10%; the bytes are kept as the rule, not fitted to one machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from servelm.attention.backend import CommonAttentionInputs, slots_of

# Queries per request up to which gathered requests are attended side by side in one padded
# batch (decodes, speculative verification); longer ones are attended one request at a time.
BATCHED_QUERY_MAX = 16


def rank_count(n: torch.Tensor, rank: int, cp_size: int) -> torch.Tensor:
    """Of positions 0..n-1 (n >= 0, long), how many live on `rank`: ceil((n - rank) / C), >= 0."""
    return torch.div(n - rank + cp_size - 1, cp_size, rounding_mode="floor")


# The ring's bytes count for about half: its next shard moves while the current one is attended,
# while the gather's all-gather and all-to-all block. Measured (RESULTS.md, "ring vs gathered
# queries", SmolLM2-135M's heads at 4k and 8k context on this CPU): the ring is faster from a chunk
# of ~0.15-0.19 of its context, where equal bytes fall at 0.32.
RING_BYTES_WEIGHT = 0.5


class Strategy(Enum):
    AUTO = "auto"  # per request, whichever moves fewer bytes
    RING = "ring"  # every request on the ring
    GATHER = "gather"  # every request's queries gathered (needs a KV pool)


@dataclass(frozen=True)
class AttentionHeads:
    """This rank's attention geometry (after tensor parallelism): what the bytes of a choice depend on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def gather_bytes(self, query_len: int, element_bytes: int) -> int:
        """Per request: its queries gathered, then a partial output and float32 lse per query returned."""
        return query_len * (2 * self.num_heads * self.head_dim * element_bytes + 4 * self.num_heads)

    def ring_bytes(self, seq_len: int, element_bytes: int) -> int:
        """Per request: all its K and V passed around the ring."""
        return seq_len * 2 * self.num_kv_heads * self.head_dim * element_bytes


@dataclass(frozen=True)
class QueryGroup:
    """Gathered requests attended together: B requests, each's gathered queries padded to Q."""

    queries: torch.Tensor  # [B, Q] long, device: row in the gathered queries (padding repeats the last)
    key_limits: torch.Tensor  # [B, Q] long, device: this rank's keys each query sees (rank_count(P + 1, r))
    slots: torch.Tensor  # [B, L] long, device: pool slots of the request's local keys 0..L-1 (0 as padding)
    real: torch.Tensor  # [B * Q] long, device: the non-padding entries of the flattened [B, Q]
    outputs: torch.Tensor  # [len(real)] long, device: their rows in the gathered queries


@dataclass(frozen=True)
class GatheredChunk:
    """A gathered request with more queries than BATCHED_QUERY_MAX, attended alone. Its queries from
    rank s are consecutive gathered rows at every C-th position, so over this rank's keys their key
    limits grow by one per query (servelm.parallel.partial_attention.causal_partial_attention)."""

    slots: torch.Tensor  # [K] long, device: pool slots of this rank's keys of the request (local 0..K-1)
    parts: tuple[tuple[int, int, int], ...]  # per rank with queries: (first row, end row, first query's key limit)


@dataclass(frozen=True)
class GatherPlan:
    rows: torch.Tensor  # [n_r] long, device: this rank's local rows whose queries are gathered
    counts: list[int]  # [C]: gathered queries from each rank (rank s's block of the gathered rows)
    groups: tuple[QueryGroup, ...]  # short requests (decodes, speculative verification) side by side
    chunks: tuple[GatheredChunk, ...]  # the others


@dataclass(frozen=True)
class RingRequest:
    queries: tuple[int, int]  # this rank's queries of the request: rows [a, b) of the ring's queries
    # [C]: keys of rank s's segment the first query sees; query i sees first_limits[s] + i of them
    # (this rank's queries are every C-th position, rank s holds every C-th key).
    first_limits: list[int]
    segments: list[tuple[int, int]]  # [C]: (offset, length) of the request's keys in rank s's shard


@dataclass(frozen=True)
class RingPlan:
    rows: torch.Tensor  # [m] long, device: this rank's local rows on the ring, request by request
    # This rank's shard: each ring request's local keys 0..n-1 in turn, its cached ones read from
    # the pool at `cached_slots`, its new ones the step's own K/V at `rows`. shard = cat(cached,
    # new)[shard_order].
    cached_slots: torch.Tensor  # [Nc] long, device
    shard_order: torch.Tensor  # [shard_lens[r]] long, device
    shard_lens: list[int]  # [C]: keys in each rank's shard
    requests: tuple[RingRequest, ...]


@dataclass(frozen=True)
class StepPlan:
    """One rank's share of a step under context parallelism."""

    local_token_index: torch.Tensor  # [T_local] long, CPU: the global batch rows this rank computes
    local_slots: torch.Tensor | None  # [T_local] long, device: physical pool slots of their K/V; None without a pool
    block_size: int  # physical block size B (the logical one / C)
    tokens_per_rank: list[int]  # [C]: T_local of every rank
    gathered_token_index: torch.Tensor  # [T] long, device: every rank's local_token_index, rank after rank
    gather: GatherPlan | None
    ring: RingPlan | None


def plan_step(
    common: CommonAttentionInputs, rank: int, cp_size: int, heads: AttentionHeads, strategy: Strategy
) -> StepPlan:
    """Rank `rank`'s plan of the step whose global inputs are `common` (module docstring)."""
    if common.has_kv_pool and common.block_size % cp_size:
        raise ValueError(f"the logical block size {common.block_size} is not a multiple of cp size {cp_size}")
    block_size = common.block_size // cp_size
    device = common.device
    q_lens, seq_lens = common.query_lens.long(), common.seq_lens.long()
    context_lens = seq_lens - q_lens
    request_of = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)  # [T]
    positions = (
        torch.arange(common.num_tokens) - common.query_start_loc[:-1].long()[request_of] + context_lens[request_of]
    )
    on_rank = positions % cp_size  # [T]
    local_token_index = torch.nonzero(on_rank == rank).flatten()
    tokens_per_rank = torch.bincount(on_rank, minlength=cp_size).tolist()
    gathered_token_index = torch.argsort(on_rank, stable=True)  # rank 0's rows, then rank 1's, ...

    on_ring = _choose_ring(common, heads, strategy)
    local_slots = None
    if common.block_table is not None:
        local_positions = positions[local_token_index] // cp_size
        local_slots = slots_of(common.block_table, request_of[local_token_index], local_positions, block_size)
        local_slots = local_slots.to(device, non_blocking=True)
    elif bool((context_lens > 0).any()) or not bool(on_ring.all()):
        raise ValueError("without a KV pool every request must be a whole prompt attended on the ring")
    local_on_ring = on_ring[request_of[local_token_index]]  # [T_local]
    gather = ring = None
    if not bool(on_ring.all()):
        gather = _plan_gather(common, ~on_ring, request_of, positions, local_on_ring, rank, cp_size, block_size)
    if bool(on_ring.any()):
        ring = _plan_ring(common, on_ring, positions[local_token_index], local_on_ring, rank, cp_size, block_size)
    return StepPlan(
        local_token_index=local_token_index,
        local_slots=local_slots,
        block_size=block_size,
        tokens_per_rank=tokens_per_rank,
        gathered_token_index=gathered_token_index.to(device, non_blocking=True),
        gather=gather,
        ring=ring,
    )


def _choose_ring(common: CommonAttentionInputs, heads: AttentionHeads, strategy: Strategy) -> torch.Tensor:
    """[R] bool: which requests go on the ring."""
    if strategy is Strategy.GATHER:
        return torch.zeros(common.num_requests, dtype=torch.bool)
    if strategy is Strategy.RING or not common.has_kv_pool:  # gathered queries read the pool
        return torch.ones(common.num_requests, dtype=torch.bool)
    element_bytes = torch.empty((), dtype=common.dtype).element_size()
    return torch.tensor(
        [
            RING_BYTES_WEIGHT * heads.ring_bytes(s, element_bytes) < heads.gather_bytes(q, element_bytes)
            for q, s in zip(common.query_lens.tolist(), common.seq_lens.tolist())
        ],
        dtype=torch.bool,
    )


def _local_key_slots(
    common: CommonAttentionInputs, request: int, num_keys: int, block_size: int
) -> torch.Tensor:  # [num_keys] long
    """Physical slots of a request's local keys 0..num_keys-1 on this rank (its own paged sequence)."""
    assert common.block_table is not None
    return slots_of(common.block_table, torch.tensor(request), torch.arange(num_keys), block_size)


def _plan_gather(
    common: CommonAttentionInputs,
    gathered: torch.Tensor,  # [R] bool: the requests whose queries are gathered
    request_of: torch.Tensor,  # [T] long
    positions: torch.Tensor,  # [T] long
    local_on_ring: torch.Tensor,  # [T_local] bool
    rank: int,
    cp_size: int,
    block_size: int,
) -> GatherPlan:
    # The gathered queries, as every rank sees them after the all-gather: rank 0's block (its
    # gathered tokens in batch order), then rank 1's, ...
    token_gathered = gathered[request_of]  # [T]
    on_rank = positions % cp_size
    order = torch.argsort(on_rank + cp_size * (~token_gathered).long(), stable=True)
    tokens = order[: int(token_gathered.sum())]  # [N] batch rows in gathered order
    counts = torch.bincount(on_rank[tokens], minlength=cp_size).tolist()
    key_limits = rank_count(positions[tokens] + 1, rank, cp_size)  # [N]
    requests = request_of[tokens]
    seq_lens = common.seq_lens.long()
    num_keys = rank_count(seq_lens, rank, cp_size)  # [R]: this rank's keys of each request

    indices = torch.nonzero(gathered).flatten().tolist()
    short = [i for i in indices if int(common.query_lens[i]) <= BATCHED_QUERY_MAX]
    groups = []
    if short:
        entries = [torch.nonzero(requests == i).flatten() for i in short]  # gathered rows of each request
        width = max(e.numel() for e in entries)
        padded = torch.stack([torch.cat([e, e[-1:].expand(width - e.numel())]) for e in entries])  # [B, Q]
        length = max(int(num_keys[i]) for i in short)
        slots = torch.zeros(len(short), length, dtype=torch.long)
        for row, i in enumerate(short):
            slots[row, : int(num_keys[i])] = _local_key_slots(common, i, int(num_keys[i]), block_size)
        real = (torch.arange(width) < torch.tensor([e.numel() for e in entries]).unsqueeze(1)).flatten()
        groups.append(
            QueryGroup(
                queries=padded.to(common.device, non_blocking=True),
                key_limits=key_limits[padded].to(common.device, non_blocking=True),
                slots=slots.to(common.device, non_blocking=True),
                real=torch.nonzero(real).flatten().to(common.device, non_blocking=True),
                outputs=padded.flatten()[real].to(common.device, non_blocking=True),
            )
        )
    chunks = []
    for i in indices:
        if i in short:
            continue
        parts = []
        for s in range(cp_size):
            rows = torch.nonzero((requests == i) & (on_rank[tokens] == s)).flatten()  # consecutive
            if rows.numel():
                first, end = int(rows[0]), int(rows[-1]) + 1
                assert end - first == rows.numel()
                parts.append((first, end, int(key_limits[first])))
        slots = _local_key_slots(common, i, int(num_keys[i]), block_size)
        chunks.append(GatheredChunk(slots.to(common.device, non_blocking=True), tuple(parts)))
    return GatherPlan(
        rows=torch.nonzero(~local_on_ring).flatten().to(common.device, non_blocking=True),
        counts=counts,
        groups=tuple(groups),
        chunks=tuple(chunks),
    )


def _plan_ring(
    common: CommonAttentionInputs,
    on_ring: torch.Tensor,  # [R] bool
    local_positions: torch.Tensor,  # [T_local] long: global positions of this rank's tokens
    local_on_ring: torch.Tensor,  # [T_local] bool
    rank: int,
    cp_size: int,
    block_size: int,
) -> RingPlan:
    seq_lens, q_lens = common.seq_lens.long(), common.query_lens.long()
    indices = torch.nonzero(on_ring).flatten().tolist()
    # Keys of each ring request on each rank: [C, R'] (rank s's shard is its requests' keys in turn).
    keys = torch.stack([rank_count(seq_lens[indices], s, cp_size) for s in range(cp_size)])
    cached = rank_count(seq_lens[indices] - q_lens[indices], rank, cp_size)  # [R'] this rank's keys from the pool
    new = keys[rank] - cached  # [R'] this rank's new tokens of each ring request
    ring_positions = local_positions[local_on_ring]  # [m], request by request
    key_offsets = torch.cumsum(keys, dim=1) - keys  # [C, R']
    cached_offsets = (torch.cumsum(cached, 0) - cached).tolist()
    new_offsets = (torch.cumsum(new, 0) - new).tolist()
    num_cached = int(cached.sum())
    cached_slots, shard_order, requests = [], [], []
    for j, i in enumerate(indices):
        c, n, a = int(cached[j]), int(new[j]), new_offsets[j]
        if c:
            cached_slots.append(_local_key_slots(common, i, c, block_size))
        shard_order += [
            torch.arange(cached_offsets[j], cached_offsets[j] + c),
            torch.arange(num_cached + a, num_cached + a + n),
        ]
        segments = [(int(key_offsets[s, j]), int(keys[s, j])) for s in range(cp_size)]
        first = ring_positions[a : a + 1] + 1  # the first query's position + 1 (none: no queries here)
        first_limits = [int(rank_count(first, s, cp_size).sum()) for s in range(cp_size)]
        requests.append(RingRequest((a, a + n), first_limits, segments))
    device = common.device
    return RingPlan(
        rows=torch.nonzero(local_on_ring).flatten().to(device, non_blocking=True),
        cached_slots=(torch.cat(cached_slots) if cached_slots else torch.zeros(0, dtype=torch.long)).to(device),
        shard_order=torch.cat(shard_order).to(device, non_blocking=True),
        shard_lens=keys.sum(dim=1).tolist(),
        requests=tuple(requests),
    )
