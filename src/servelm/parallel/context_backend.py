"""The context-parallel attention backend: one request's tokens and K/V over the CP ranks.

The runner of each CP rank builds the step's GLOBAL `CommonAttentionInputs` (every request's new
tokens, global positions, logical block ids, the logical block size), calls `build_metadata`
once, and runs the model on the rows `metadata.local_token_index` names only (servelm.parallel.
context_layout: rank r computes the new tokens at positions p with p % C == r). Each layer's
`forward` writes those tokens' K/V into this rank's pool and attends their queries to the
request's keys on every rank: gathered queries or a ring, per request. `gather_hidden` puts
the ranks' final hidden states back in global batch order for the sampler.

Every rank joins every collective of a step, in the same order, also with no tokens of its own
(T_local = 0): the plan says which collectives run, and every rank plans the same step.

The attention math is servelm.parallel.partial_attention's, not an inner backend's: merging
parts needs each part's log-sum-exp, which the AttentionBackend protocol does not return.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.attention.backend import AttentionMetadata, CommonAttentionInputs
from servelm.attention.kv_storage import LayerKVCache, QuantizedKV, gather_kv, write_kv
from servelm.parallel.context_layout import (
    AttentionHeads,
    GatherPlan,
    RingPlan,
    StepPlan,
    Strategy,
    plan_step,
)
from servelm.parallel.exchange import all_gather_rows, all_to_all_rows, as_byte_rows, from_byte_rows
from servelm.parallel.groups import GroupMember
from servelm.parallel.partial_attention import causal_partial_attention, merge_partials, padded_partial_attention
from servelm.parallel.ring import ring_shards


@dataclass(frozen=True)
class ContextParallelMetadata(AttentionMetadata):
    """This rank's plan of one step (context_layout.StepPlan), read by every layer."""

    plan: StepPlan

    @property
    def local_token_index(self) -> torch.Tensor:  # [T_local] long, CPU
        return self.plan.local_token_index

    @property
    def reads_kv_pool(self) -> bool:
        ring = self.plan.ring
        return self.plan.gather is not None or (ring is not None and ring.cached_slots.numel() > 0)


class ContextParallelBackend:
    """See the module. `heads` is this rank's attention geometry (after tensor parallelism), which
    the per-request choice between gathering queries and the ring weighs; `strategy` forces one."""

    name = "context_parallel"

    def __init__(self, cp: GroupMember, heads: AttentionHeads, strategy: Strategy = Strategy.AUTO) -> None:
        self.cp = cp
        self.heads = heads
        self.strategy = strategy

    def build_metadata(self, common: CommonAttentionInputs) -> ContextParallelMetadata:
        """See `AttentionBackend.build_metadata`: once per step, pure; `common` is the step's global
        batch with logical block ids and the logical block size (physical block size * C)."""
        return ContextParallelMetadata(plan_step(common, self.cp.rank, self.cp.size, self.heads, self.strategy))

    def forward(
        self,
        query: torch.Tensor,  # [T_local, H, D]: this rank's tokens (metadata.local_token_index)
        key: torch.Tensor,  # [T_local, KVH, D]
        value: torch.Tensor,  # [T_local, KVH, D]
        kv_cache: LayerKVCache | None,  # this rank's pool [2, num_blocks, B, KVH, D], B = logical block size / C
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T_local, H, D]: causal attention over the request's keys on every rank
        if not isinstance(metadata, ContextParallelMetadata):
            raise TypeError(
                f"the context-parallel backend needs ContextParallelMetadata, got {type(metadata).__name__}"
            )
        plan = metadata.plan
        if kv_cache is not None:
            if plan.local_slots is None:
                raise ValueError("a KV pool was given but the metadata was built without one")
            pool_block_size = (kv_cache.data if isinstance(kv_cache, QuantizedKV) else kv_cache).shape[2]
            if pool_block_size != plan.block_size:
                raise ValueError(f"the pool's blocks hold {pool_block_size} tokens, the plan's {plan.block_size}")
            # Attend to K/V as stored (dequantized codes for an int8 / fp8 pool), as the torch backend does.
            key, value = write_kv(kv_cache, key, value, plan.local_slots)
        elif metadata.reads_kv_pool:
            raise ValueError("the metadata reads K/V from the pool but no kv_cache was given")
        output = query.new_empty(query.shape)
        if plan.gather is not None:
            assert kv_cache is not None  # plan_step gathers only with a pool
            output[plan.gather.rows] = self._attend_gathered(query, kv_cache, plan.gather, scale)
        if plan.ring is not None:
            output[plan.ring.rows] = self._attend_ring(query, key, value, kv_cache, plan.ring, scale)
        return output

    def gather_hidden(self, hidden_local: torch.Tensor, metadata: ContextParallelMetadata) -> torch.Tensor:
        """[T_local, D] per rank → [T, D] in global batch order, on every CP rank (one all-gather)."""
        plan = metadata.plan
        gathered = all_gather_rows(hidden_local, self.cp, plan.tokens_per_rank)  # rank 0's rows, then rank 1's...
        hidden = gathered.new_empty(gathered.shape)
        hidden[plan.gathered_token_index] = gathered
        return hidden

    def _attend_gathered(
        self, query: torch.Tensor, kv_cache: LayerKVCache, plan: GatherPlan, scale: float
    ) -> torch.Tensor:  # [n_r, H, D]
        """Every rank's gathered queries over this rank's keys; the partials go home and merge."""
        queries = all_gather_rows(query[plan.rows], self.cp, plan.counts)  # [N, H, D]
        num_heads = query.shape[1]
        outs = queries.new_zeros(queries.shape)
        lses = torch.full((queries.shape[0], num_heads), float("-inf"), device=query.device)
        for group in plan.groups:
            k = gather_kv(kv_cache, 0, group.slots, query.dtype)  # [B, L, KVH, D]
            v = gather_kv(kv_cache, 1, group.slots, query.dtype)
            out, lse = padded_partial_attention(queries[group.queries], k, v, group.key_limits, scale)
            outs[group.outputs] = out.flatten(0, 1)[group.real]
            lses[group.outputs] = lse.flatten(0, 1)[group.real]
        for chunk in plan.chunks:
            k, v = (gather_kv(kv_cache, which, chunk.slots, query.dtype) for which in (0, 1))  # [K, KVH, D]
            for first, end, first_limit in chunk.parts:
                outs[first:end], lses[first:end] = causal_partial_attention(
                    queries[first:end], k, v, first_limit, scale
                )
        # One message per destination: each partial row's output bytes, then its lse bytes.
        packed = torch.cat([as_byte_rows(outs), as_byte_rows(lses)], dim=1)
        mine = plan.counts[self.cp.rank]
        returned = all_to_all_rows(packed, self.cp, plan.counts, [mine] * self.cp.size, any_rows=sum(plan.counts) > 0)
        split = as_byte_rows(outs[:0]).shape[1]
        parts = returned.view(self.cp.size, mine, packed.shape[1])  # [C, n_r, bytes]: rank s's partials of my queries
        part_outs = [from_byte_rows(p[:, :split], query.dtype, query.shape[1:]) for p in parts]
        part_lses = [from_byte_rows(p[:, split:], torch.float32, (num_heads,)) for p in parts]
        return merge_partials(part_outs, part_lses)

    def _attend_ring(
        self,
        query: torch.Tensor,
        key: torch.Tensor,  # [T_local, KVH, D] as stored
        value: torch.Tensor,
        kv_cache: LayerKVCache | None,
        plan: RingPlan,
        scale: float,
    ) -> torch.Tensor:  # [m, H, D]
        """This rank's ring queries over every rank's shard of their requests' keys."""
        queries = query[plan.rows]  # [m, H, D], request by request
        kv_shape = key.shape[1:]
        cached = [torch.zeros(0, *kv_shape, dtype=query.dtype, device=query.device)] * 2
        if plan.cached_slots.numel():
            assert kv_cache is not None
            cached = [gather_kv(kv_cache, which, plan.cached_slots, query.dtype) for which in (0, 1)]
        # [shard_lens[r], 2, KVH, D]: K and V of a key side by side, one message per round.
        shard = torch.stack(
            [
                torch.cat([cached[0], key[plan.rows]])[plan.shard_order],
                torch.cat([cached[1], value[plan.rows]])[plan.shard_order],
            ],
            dim=1,
        )
        outs: list[list[torch.Tensor]] = [[] for _ in plan.requests]
        lses: list[list[torch.Tensor]] = [[] for _ in plan.requests]
        for source, held in ring_shards(shard, plan.shard_lens, self.cp):
            for j, request in enumerate(plan.requests):
                a, b = request.queries
                if a == b:
                    continue
                offset, length = request.segments[source]
                kv = held[offset : offset + length]
                limit = request.first_limits[source]
                out, lse = causal_partial_attention(queries[a:b], kv[:, 0], kv[:, 1], limit, scale)
                outs[j].append(out)
                lses[j].append(lse)
        merged = [merge_partials(o, s) for o, s in zip(outs, lses) if o]
        return torch.cat(merged) if merged else queries.new_empty(queries.shape)
