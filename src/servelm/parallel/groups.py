"""Ranks and process groups of a multi-rank worker (tensor x context parallelism).

    world rank = cp_rank * tp_size + tp_rank

    tp=2, cp=2:   rank 0 (tp 0, cp 0)   rank 1 (tp 1, cp 0)     ← one tensor-parallel group per cp rank
                  rank 2 (tp 0, cp 1)   rank 3 (tp 1, cp 1)     ← one context-parallel group per tp rank

Rank 0 is the engine core (it schedules and samples); the others follow its schedule. Every
group is created on every rank in the same order (torch.distributed requires it), with the
configured timeout, so a dead rank turns a collective into an error, not a hang.

A single rank (`ParallelGroups.single()`) needs no torch.distributed at all: every collective
helper below is then the identity, so the one-rank code path is the multi-rank one.

On CPU (gloo), a group whose ranks all live on this host also gets a shared-memory segment
(shm_collectives.py): the helpers below send the tensors that fit through it, tens of
microseconds a call instead of gloo's loopback TCP; gloo carries the rest (and everything on
other hosts). Which path a call takes depends only on sizes every rank agrees on.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from servelm.parallel.shm_collectives import SharedMemoryGroup


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.context_parallel_size < 1:
            raise ValueError(f"parallel sizes must be >= 1, got {self}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size

    def rank_of(self, tp_rank: int, cp_rank: int) -> int:
        return cp_rank * self.tensor_parallel_size + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(tp_rank, cp_rank) of a world rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return rank % self.tensor_parallel_size, rank // self.tensor_parallel_size

    def tp_ranks(self, cp_rank: int) -> list[int]:
        return [self.rank_of(t, cp_rank) for t in range(self.tensor_parallel_size)]

    def cp_ranks(self, tp_rank: int) -> list[int]:
        return [self.rank_of(tp_rank, c) for c in range(self.context_parallel_size)]


@dataclass(frozen=True)
class GroupMember:
    """One rank's place in one parallel dimension: its rank in it, the dimension's size, and the
    process group (None when the size is 1: no collective is ever issued)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    # Same-host CPU groups: the segment that carries the small collectives (None: gloo carries all).
    shared_memory: SharedMemoryGroup | None = None

    @property
    def is_parallel(self) -> bool:
        return self.size > 1


# A dimension of one rank (every default of a `tp` / `cp` argument): no group, no collective.
SINGLE_RANK = GroupMember()


@dataclass(frozen=True)
class ParallelGroups:
    layout: ParallelLayout
    rank: int  # world rank
    tp: GroupMember
    cp: GroupMember
    world: dist.ProcessGroup | None  # every rank (rank 0's schedule goes out on it); None alone

    @classmethod
    def single(cls) -> ParallelGroups:
        return cls(ParallelLayout(), 0, GroupMember(), GroupMember(), None)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the engine core's own rank."""
        return self.rank == 0

    @classmethod
    def initialize(
        cls, layout: ParallelLayout, rank: int, init_method: str, backend: str, timeout_s: float,
        *, shared_memory: bool = True,
    ) -> ParallelGroups:  # fmt: skip
        """Join the world (blocks until every rank has joined, or fails after `timeout_s`) and
        create the groups, the same calls in the same order on every rank; with `shared_memory`
        and gloo, each group whose ranks share this host gets its shared-memory segment (its
        waits fail after `timeout_s` too)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=layout.world_size, timeout=timeout
        )
        tp_rank, cp_rank = layout.coords(rank)
        tp_group = cp_group = None
        for c in range(layout.context_parallel_size):
            group = dist.new_group(layout.tp_ranks(c), timeout=timeout) if layout.tensor_parallel_size > 1 else None
            if c == cp_rank:
                tp_group = group
        for t in range(layout.tensor_parallel_size):
            group = dist.new_group(layout.cp_ranks(t), timeout=timeout) if layout.context_parallel_size > 1 else None
            if t == tp_rank:
                cp_group = group
        def segment(group: dist.ProcessGroup | None) -> SharedMemoryGroup | None:
            if group is None or not shared_memory or backend != "gloo":
                return None
            return SharedMemoryGroup.create(group, timeout_s)

        return cls(
            layout,
            rank,
            GroupMember(tp_rank, layout.tensor_parallel_size, tp_group, segment(tp_group)),
            GroupMember(cp_rank, layout.context_parallel_size, cp_group, segment(cp_group)),
            dist.group.WORLD,
        )

    def close(self) -> None:
        """Unmap the groups' shared-memory segments (before leaving the world; the process groups
        themselves go with dist.destroy_process_group)."""
        for member in (self.tp, self.cp):
            if member.shared_memory is not None:
                member.shared_memory.close()


def default_backend(device: torch.device) -> str:
    """nccl for CUDA tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def all_reduce_sum(tensor: torch.Tensor, member: GroupMember) -> torch.Tensor:
    """Sum over the dimension's ranks, in place; the identity alone. Through shared memory the sum
    runs in rank order and every rank gets bitwise the same tensor (gloo's too)."""
    if member.is_parallel:
        shm = member.shared_memory
        with COMMUNICATION.timed():
            if shm is not None and shm.fits(tensor, tensor.numel()):
                shm.all_reduce_sum_(tensor)
            else:
                dist.all_reduce(tensor, group=member.group)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, member: GroupMember, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's `tensor` along its last dimension, rank order; rank i's last
    dimension is sizes[i] (shards may be uneven). The identity alone.

    gloo's all_gather refuses tensors of different sizes: uneven shards are padded to the largest
    and cut again after the gather (even ones travel as they are); shared memory takes them as
    they are.
    """
    if not member.is_parallel:
        return tensor
    width = max(sizes)
    rows = math.prod(tensor.shape[:-1])
    shm = member.shared_memory
    if shm is not None and shm.fits(tensor, rows * width):
        with COMMUNICATION.timed():
            parts = shm.all_gather(tensor, [rows * size for size in sizes])
            return torch.cat([part.view(*tensor.shape[:-1], size) for part, size in zip(parts, sizes)], dim=-1)
    local = tensor.contiguous()
    if local.shape[-1] != width:
        local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
    gathered = torch.empty(member.size, *tensor.shape[:-1], width, dtype=tensor.dtype, device=tensor.device)
    with COMMUNICATION.timed():
        dist.all_gather(list(gathered.unbind(0)), local, group=member.group)
    return torch.cat([part[..., :size] for part, size in zip(gathered.unbind(0), sizes, strict=True)], dim=-1)


@dataclass
class CommunicationTimer:
    """Wall seconds this process spent inside collectives (benchmarks report it as a share of the
    step). Process-wide: one engine per process is the multi-rank case."""

    seconds: float = 0.0
    calls: int = 0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1


COMMUNICATION = CommunicationTimer()
