"""Tensor parallelism's partition math: which heads, KV heads, MLP columns and vocabulary rows a
rank of a `tp_size`-rank group holds. Pure integer arithmetic (no torch, no model code).

Every split is contiguous, in rank order; when the total does not divide, the first ranks get one
unit more. Attention follows the KV groups (GQA): a query head always lives on a rank that holds
its KV head, so attention needs no communication.

    9 heads / 3 KV heads (group of 3), tp 2:        4 heads / 2 KV heads (group of 2), tp 4:
      rank 0: KV {0, 1}   q 0-5                       rank 0: KV {0}  q 0     rank 2: KV {1}  q 2
      rank 1: KV {2}      q 6-8                       rank 1: KV {0}  q 1     rank 3: KV {1}  q 3

With no more ranks than KV heads, the KV heads are split and each takes its whole group of query
heads. With more, every KV head is replicated on tp_size / num_kv_heads ranks (which must divide)
and its group's query heads are split among those ranks.

MLP columns (the intermediate dimension) and vocabulary rows split contiguously; an `align`ed
split keeps every boundary a multiple of `align` (32 for weights stored as GGUF blocks of 32
inputs, whose column shards must start and end on a block).
"""

from __future__ import annotations

from dataclasses import dataclass


def split_ranges(total: int, num_parts: int, *, align: int = 1, what: str = "items") -> list[range]:
    """`total` items as `num_parts` contiguous, non-empty ranges, rank order, boundaries multiples of
    `align`; sizes differ by at most `align` (the first ranks get the extra units).

    Raises ValueError (naming `what` and the sizes) when `total` is not a multiple of `align` or
    there are fewer aligned units than parts (a rank would hold nothing).
    """
    if num_parts < 1 or align < 1:
        raise ValueError(f"cannot split {what} into {num_parts} parts aligned to {align}")
    if total % align:
        raise ValueError(f"cannot split {total} {what} in multiples of {align}: {total} is not a multiple of {align}")
    units = total // align
    if units < num_parts:
        unit = "" if align == 1 else f" (in multiples of {align})"
        raise ValueError(
            f"cannot split {total} {what} over {num_parts} tensor-parallel ranks{unit}: a rank would hold none"
        )
    base, extra = divmod(units, num_parts)
    ranges, start = [], 0
    for part in range(num_parts):
        stop = start + (base + (part < extra)) * align
        ranges.append(range(start, stop))
        start = stop
    return ranges


@dataclass(frozen=True)
class AttentionShard:
    """The attention heads one rank computes: global ids, each a contiguous range."""

    q_heads: range
    kv_heads: range

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def attention_shards(num_heads: int, num_kv_heads: int, tp_size: int) -> list[AttentionShard]:
    """Every rank's heads, rank order (see the module docstring for the rule).

    Raises ValueError naming the sizes when they cannot be split: more ranks than KV heads but not a
    multiple of them, or more ranks sharing a KV head than its group has query heads.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not form groups over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv_ranges = split_ranges(num_kv_heads, tp_size, what="KV heads")
        return [AttentionShard(range(kv.start * group, kv.stop * group), kv) for kv in kv_ranges]
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} cannot split {num_kv_heads} KV heads: with more ranks than KV heads "
            f"the ranks must be a multiple of the KV heads (each KV head is replicated on tp_size / {num_kv_heads} ranks)"
        )
    replicas = tp_size // num_kv_heads
    if group < replicas:
        raise ValueError(
            f"tensor_parallel_size {tp_size} cannot split {num_heads} query heads / {num_kv_heads} KV heads: each KV "
            f"head's {group} query head(s) would be shared by {replicas} ranks, leaving a rank without a query head"
        )
    in_group = split_ranges(group, replicas, what="query heads of a KV group")
    shards = []
    for rank in range(tp_size):
        kv, q = divmod(rank, replicas)
        first = kv * group
        shards.append(AttentionShard(range(first + in_group[q].start, first + in_group[q].stop), range(kv, kv + 1)))
    return shards


def attention_shard(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> AttentionShard:
    """The heads rank `tp_rank` of `tp_size` computes; ValueError as `attention_shards`."""
    return attention_shards(num_heads, num_kv_heads, tp_size)[tp_rank]


def mlp_shards(intermediate_size: int, tp_size: int, align: int = 1) -> list[range]:
    """Every rank's MLP columns (of gate/up's rows and down's inputs), rank order."""
    return split_ranges(intermediate_size, tp_size, align=align, what="MLP columns")


def vocab_shards(vocab_size: int, tp_size: int) -> list[range]:
    """Every rank's vocabulary rows (of the embedding and the LM head), rank order."""
    return split_ranges(vocab_size, tp_size, what="vocabulary rows")
