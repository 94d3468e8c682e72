"""Ring attention: K/V shards travel around the context-parallel ranks, queries stay.

    round 0:  rank r attends its queries to its own shard     │ sends it to r+1, receives r-1's
    round 1:  ... to the shard of rank r-1                    │ passes it on, receives r-2's
    ...
    round C-1: ... to the shard of rank r+1                   │ (nothing left to move)

Each round's transfer is posted before that round's compute, so the next shard is on the wire
while this one is attended. Partial outputs merge exactly by their log-sum-exp
(servelm.parallel.partial_attention). Per rank and step the ring moves C-1 shards: every
request's keys once, (C-1)/C of them received per rank, however many queries the rank has.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from servelm.parallel.exchange import all_gather_rows, as_byte_rows, from_byte_rows
from servelm.parallel.groups import COMMUNICATION, GroupMember
from servelm.parallel.partial_attention import merge_partials, partial_attention


def ring_shards(
    shard: torch.Tensor,  # [shard_lens[cp.rank], ...] this rank's shard, any dtype
    shard_lens: Sequence[int],  # rows of every rank's shard (all ranks pass the same list)
    cp: GroupMember,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (source rank, its shard) for every rank of the group, this rank's first, then those
    of ranks r-1, r-2, ...; while the caller works on one, the next one is being received.
    Every rank must consume the iterator to the end (each round is a send and a receive)."""
    if shard.shape[0] != shard_lens[cp.rank]:
        raise ValueError(f"rank {cp.rank}'s shard has {shard.shape[0]} rows, shard_lens says {shard_lens[cp.rank]}")
    size, rank = cp.size, cp.rank
    held = as_byte_rows(shard)
    row_bytes = held.shape[1]
    if size > 1:
        if cp.group is None:
            raise ValueError(f"a context-parallel dimension of {size} ranks needs its process group")
        next_rank = dist.get_global_rank(cp.group, (rank + 1) % size)
        prev_rank = dist.get_global_rank(cp.group, (rank - 1) % size)
    for step in range(size):
        source = (rank - step) % size
        incoming = (rank - step - 1) % size  # the shard rank r-1 holds this round
        requests = []
        received = None
        if step < size - 1:
            # Both sides know every shard's length, so an empty one is skipped on both.
            ops = []
            if shard_lens[source] > 0:
                ops.append(dist.P2POp(dist.isend, held, next_rank, cp.group))
            if shard_lens[incoming] > 0:
                received = held.new_empty(shard_lens[incoming], row_bytes)
                ops.append(dist.P2POp(dist.irecv, received, prev_rank, cp.group))
            if ops:
                requests = dist.batch_isend_irecv(ops)
        yield source, from_byte_rows(held, shard.dtype, shard.shape[1:])
        with COMMUNICATION.timed():  # only the wait blocks: the transfer overlapped the attention
            for request in requests:
                request.wait()
        if step < size - 1:
            held = received if received is not None else held.new_empty(0, row_bytes)


def ring_attention(
    q: torch.Tensor,  # [Tq, H, D] this rank's queries of one request
    q_positions: torch.Tensor,  # [Tq] long: their positions in the request
    k: torch.Tensor,  # [Tk, KVH, D] this rank's keys of the request (any uneven share)
    v: torch.Tensor,  # [Tk, KVH, D]
    k_positions: torch.Tensor,  # [Tk] long, ascending: the keys' positions
    cp: GroupMember,
    scale: float,
) -> torch.Tensor:  # [Tq, H, D]: causal attention of q over every rank's keys (position <= query's)
    """Causal attention of one request whose queries and keys are spread over the CP ranks in any
    way (each rank's keys in ascending position order). One small all-gather learns the shards'
    lengths; positions travel with the K/V, packed as bytes into one message per round."""
    lens = all_gather_rows(torch.tensor([k.shape[0]], device=k.device), cp, [1] * cp.size).tolist()
    packed = torch.cat(
        [as_byte_rows(k), as_byte_rows(v), as_byte_rows(k_positions.to(device=k.device, dtype=torch.long))], dim=1
    )
    kv_bytes = as_byte_rows(k).shape[1]
    outs, lses = [], []
    for _, shard in ring_shards(packed, lens, cp):
        shard_k = from_byte_rows(shard[:, :kv_bytes], k.dtype, k.shape[1:])
        shard_v = from_byte_rows(shard[:, kv_bytes : 2 * kv_bytes], v.dtype, v.shape[1:])
        shard_positions = from_byte_rows(shard[:, 2 * kv_bytes :], torch.long, ()).flatten()
        # Keys ascend, so the keys a query sees (position <= its own) are a prefix of the shard.
        key_limits = torch.searchsorted(shard_positions, q_positions.to(shard_positions.device), right=True)
        out, lse = partial_attention(q, shard_k, shard_v, key_limits, scale)
        outs.append(out)
        lses.append(lse)
    return merge_partials(outs, lses)
