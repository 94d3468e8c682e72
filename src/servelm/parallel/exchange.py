"""Row-wise exchanges over a group with uneven row counts per rank, for tensors of any dtype.

Every rank passes the counts of every rank (each rank plans them from the same step, so they
agree without a message). Tensors travel as their raw bytes, one uint8 row per tensor row: gloo
has no float8 (nor bfloat16 everywhere), and one byte buffer carries tensors of different dtypes
together (a partial output and its float32 log-sum-exp). A collective whose every count is 0 is
skipped on every rank alike.

gloo's all_gather wants equal sizes: uneven gathers are padded to the largest count. A group
with a shared-memory segment (groups.py) gathers the rows that fit through it, unpadded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from servelm.parallel.groups import COMMUNICATION, GroupMember


def as_byte_rows(x: torch.Tensor) -> torch.Tensor:
    """[N, ...] of any dtype → [N, bytes per row] uint8 (a view when x is contiguous)."""
    row_elements = math.prod(x.shape[1:])
    return x.contiguous().view(x.shape[0], row_elements).view(torch.uint8)


def from_byte_rows(rows: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The inverse of `as_byte_rows`: [N, bytes] uint8 → [N, *shape] of `dtype`."""
    return rows.contiguous().view(dtype).view(rows.shape[0], *shape)


def all_gather_rows(x: torch.Tensor, member: GroupMember, counts: Sequence[int]) -> torch.Tensor:
    """Every rank's rows, in rank order: x is [counts[member.rank], ...]; returns [sum(counts), ...]."""
    if x.shape[0] != counts[member.rank]:
        raise ValueError(f"rank {member.rank} has {x.shape[0]} rows, its count says {counts[member.rank]}")
    if not member.is_parallel:
        return x
    widest = max(counts)
    if widest == 0:
        return x
    rows = as_byte_rows(x)
    shm = member.shared_memory
    if shm is not None and shm.fits(rows, widest * rows.shape[1]):
        with COMMUNICATION.timed():
            parts = shm.all_gather(rows, [n * rows.shape[1] for n in counts])
            gathered = torch.cat([part.view(n, rows.shape[1]) for part, n in zip(parts, counts)])
        return from_byte_rows(gathered, x.dtype, x.shape[1:])
    padded = rows.new_zeros(widest, rows.shape[1])
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(member.size)]
    with COMMUNICATION.timed():
        dist.all_gather(parts, padded, group=member.group)
    gathered = torch.cat([part[:n] for part, n in zip(parts, counts)])
    return from_byte_rows(gathered, x.dtype, x.shape[1:])


def all_to_all_rows(
    x: torch.Tensor,  # [sum(send_counts), ...]: rows for rank 0, then rank 1, ...
    member: GroupMember,
    send_counts: Sequence[int],  # rows this rank sends to each rank
    recv_counts: Sequence[int],  # rows this rank receives from each rank
    any_rows: bool,  # whether any rank sends any row (all ranks must agree): False skips the collective
) -> torch.Tensor:  # [sum(recv_counts), ...]: rows from rank 0, then rank 1, ...
    """Rank r's block s goes to rank s, which gets it as its block r."""
    if not member.is_parallel:
        return x
    if not any_rows:
        return x.new_empty(0, *x.shape[1:])
    rows = as_byte_rows(x)
    received = rows.new_empty(sum(recv_counts), rows.shape[1])
    with COMMUNICATION.timed():
        dist.all_to_all_single(
            received, rows, output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts),
            group=member.group,
        )  # fmt: skip
    return from_byte_rows(received, x.dtype, x.shape[1:])
