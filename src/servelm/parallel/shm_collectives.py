"""Same-host collectives through one shared-memory segment per group, for the small tensors of a
CPU step (a decode step makes ~62 all-reduces / all-gathers of a few KiB: over gloo's loopback TCP
each costs 0.3-0.8 ms, through shared memory tens of microseconds).

Segment layout, W ranks, C bytes per slot (`slot_bytes`):

    0           arrived[0] | arrived[1] | ... | arrived[W-1]     int64 each, one per 64-byte line
    HEADER      buffer 0:  slot 0 | slot 1 | ... | slot W-1      C bytes each
    HEADER+W*C  buffer 1:  slot 0 | slot 1 | ... | slot W-1

Every rank numbers its calls 1, 2, 3, ... (the ranks of a group make the same collectives in the
same order); call g uses buffer g % 2:

    1. rank r copies its tensor into its slot of buffer g % 2
    2. sets arrived[r] = g                   (after the copy: x86-64 keeps stores in program order)
    3. waits until arrived[p] >= g for every peer p, then reads every slot into its own output: the
       sum in rank order (slot 0 + slot 1 + ...), so every rank computes bitwise the same tensor, or
       the concatenation.

Why no slot is overwritten while a peer still reads it (the second phase is the double buffer):
rank r writes buffer g % 2 again at call g + 2, which it reaches only after call g + 1's wait saw
every peer arrive at g + 1, and a peer arrives there only once it has finished reading call g. A
peer is at most one call ahead (it cannot pass call g + 1's wait before r arrives there), so two
buffers suffice. DeepSpeed's and vLLM's CPU shared-memory all-reduce use the same double buffer
with three rotating states; a monotone int64 counter does their job and never wraps.

A wait spins (a peer is usually microseconds away), then yields the CPU (a peer may share our
core), then sleeps with a growing pause; it fails with RuntimeError naming the rank it waited for
after `timeout_s`, or as soon as that rank's process is gone. A failed wait leaves the ranks out of
step for good: every later call on the group raises too.

Lifetime: the segment's name exists only during set-up. The group's first rank creates
/dev/shm/servelm-shm-<pid>-<random>, broadcasts the name over the gloo group, the others map it,
and once every rank has said whether it could (a gather over gloo) the creator unlinks the name
(a barrier: when `create` returns on any rank, the name is gone).
The memory lives while a rank maps it; the kernel frees it when the last one unmaps (close(), or
its process ending however it ends): nothing outlives set-up in /dev/shm.

Limits: x86-64 only (its store order is what step 2 relies on; elsewhere `create` returns None and
gloo carries everything), CPU tensors of at most `slot_bytes`; callers fall back to gloo for
anything else (the decision depends only on shapes every rank agrees on).
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
T = TypeVar("T")

SHM_DIRECTORY = Path("/dev/shm")
DEFAULT_SLOT_BYTES = 4 << 20  # a [1024, 1024] float32 all-reduce; larger tensors go over gloo
COUNTER_STRIDE = 8  # int64 counters, one per 64-byte cache line: writers never share a line
HEADER_ALIGN = 4096
SPIN_CHECKS = 2000  # ~0.1 ms of tight polling before yielding
YIELD_S = 5e-3  # then sched_yield (the CPU goes to whoever else wants it) for this long before sleeping
SLEEP_MIN_S, SLEEP_MAX_S = 50e-6, 200e-6  # a sleeping wait wakes at most ~0.2 ms late
LIVENESS_EVERY_S = 0.1  # how often a long wait checks that the awaited rank's process exists


class SharedMemoryGroup:
    """A group's shared-memory collectives, on one rank. Build it with `create` (a collective over
    the group's gloo group). Every method is called by one thread; every rank of the group must make
    the same calls, same order, same sizes (as with any collective)."""

    def __init__(
        self, name: str, segment: mmap.mmap, rank: int, size: int, slot_bytes: int, pids: Sequence[int],
        world_ranks: Sequence[int], timeout_s: float,
    ) -> None:  # fmt: skip
        self.name = name  # under /dev/shm during set-up only (diagnostics, tests)
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        self._segment = segment
        self._pids = list(pids)
        self._world_ranks = list(world_ranks)
        self._peers = [p for p in range(size) if p != rank]
        self._arrived = memoryview(segment)[: _header_bytes(size)].cast("q")
        data = torch.frombuffer(segment, dtype=torch.uint8, offset=_header_bytes(size))
        # _slots[buffer][rank]: that rank's slot of that buffer, bytes
        self._slots = [[data[(b * size + r) * slot_bytes : (b * size + r + 1) * slot_bytes] for r in range(size)]
                       for b in range(2)]  # fmt: skip
        self._calls = 0
        self._broken: str | None = None

    @classmethod
    def create(
        cls, group: dist.ProcessGroup, timeout_s: float, slot_bytes: int = DEFAULT_SLOT_BYTES
    ) -> SharedMemoryGroup | None:
        """Set up the segment of `group` (a CPU process group: gloo). Every rank of the group calls
        it; all get a SharedMemoryGroup, or all get None: the ranks are not on one host (hostname, /dev/shm
        and pid namespace compared), this is not x86-64, or some rank could not create or map the
        segment (too small a /dev/shm: the space is reserved up front, never a SIGBUS later)."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        places: list[object] = [None] * size
        dist.all_gather_object(places, _place(), group=group)
        if platform.machine() not in ("x86_64", "AMD64") or any(place != places[0] for place in places):
            return None
        total = _header_bytes(size) + 2 * size * slot_bytes
        name: list[str | None] = [_try(lambda: _new_segment(total), "create") if rank == 0 else None]
        segment: mmap.mmap | None = None
        states: list[tuple[bool, int] | None] = [None] * size
        try:
            dist.broadcast_object_list(name, group=group, group_src=0)
            if name[0] is not None:
                segment = _try(lambda: _map(SHM_DIRECTORY / str(name[0]), total), "map")
            dist.all_gather_object(states, (segment is not None, os.getpid()), group=group)
        finally:
            if rank == 0 and name[0] is not None:  # every rank has mapped it, or failed: the name has done its job
                (SHM_DIRECTORY / name[0]).unlink(missing_ok=True)
        dist.barrier(group=group)  # no rank goes on before the name is gone
        if segment is None or not all(state is not None and state[0] for state in states):
            if segment is not None:
                segment.close()
            return None
        pids = [state[1] for state in states if state is not None]
        world_ranks = dist.get_process_group_ranks(group)
        return cls(str(name[0]), segment, rank, size, slot_bytes, pids, world_ranks, timeout_s)

    def fits(self, tensor: torch.Tensor, largest_numel: int) -> bool:
        """Whether this group carries a collective whose largest part is `largest_numel` elements of
        `tensor`'s dtype (a CPU tensor). Every rank answers the same given the same sizes."""
        return tensor.device.type == "cpu" and largest_numel * tensor.element_size() <= self.slot_bytes

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group's ranks, in place; the sum runs in rank order on every rank,
        so every rank holds bitwise the same result. Requires `fits(tensor, tensor.numel())`."""
        local = tensor.contiguous().view(-1)  # a view of `tensor` itself when it is contiguous
        parts = self._exchange(local, [local.numel()] * self.size)
        torch.add(parts[0], parts[1], out=local)
        for part in parts[2:]:
            local.add_(part)
        if not tensor.is_contiguous():
            tensor.copy_(local.view(tensor.shape))
        return tensor

    def all_gather(self, local: torch.Tensor, numels: Sequence[int]) -> list[torch.Tensor]:
        """Every rank's 1-D `local` (rank r's has numels[r] elements, one dtype on all ranks), rank
        order, as views into the segment: valid until this rank's next call on the group (copy them
        out, e.g. with torch.cat). Requires `fits(local, max(numels))`."""
        return self._exchange(local.contiguous().view(-1), numels)

    @property
    def closed(self) -> bool:
        return self._segment.closed

    def close(self) -> None:
        """Unmap the segment (it is freed once every rank has). Safe to call twice; later calls fail."""
        self._broken = "the shared-memory group is closed"
        self._arrived.release()
        self._slots = []
        try:
            self._segment.close()
        except BufferError:  # a view handed out by all_gather is still alive: the mapping goes with it
            pass

    # -- one call ----------------------------------------------------------------------------

    def _exchange(self, local: torch.Tensor, numels: Sequence[int]) -> list[torch.Tensor]:
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if local.numel() != numels[self.rank]:
            raise ValueError(f"rank {self.rank} has {local.numel()} elements, its count says {numels[self.rank]}")
        self._calls += 1
        generation = self._calls
        slots = self._slots[generation % 2]
        dtype, itemsize = local.dtype, local.element_size()
        slots[self.rank][: local.numel() * itemsize].view(dtype).copy_(local)
        self._arrived[self.rank * COUNTER_STRIDE] = generation
        self._wait(generation)
        return [slot[: n * itemsize].view(dtype) for slot, n in zip(slots, numels, strict=True)]

    def _wait(self, generation: int) -> None:
        """Return once every peer has arrived at `generation`; RuntimeError after `timeout_s` or
        when the awaited peer's process is gone."""
        arrived, stride = self._arrived, COUNTER_STRIDE
        pending = [p for p in self._peers if arrived[p * stride] < generation]
        if not pending:
            return
        for _ in range(SPIN_CHECKS):
            if arrived[pending[0] * stride] >= generation:
                pending.pop(0)
                if not pending:
                    return
        started = time.monotonic()
        next_liveness, pause = started + LIVENESS_EVERY_S, SLEEP_MIN_S
        while pending:
            if arrived[pending[0] * stride] >= generation:
                pending.pop(0)
                continue
            now = time.monotonic()
            if now - started > self.timeout_s:
                self._fail(pending[0], generation, f"did not arrive within {self.timeout_s:g} s")
            if now >= next_liveness:
                if not process_alive(self._pids[pending[0]]):
                    self._fail(pending[0], generation, "is gone")
                next_liveness = now + LIVENESS_EVERY_S
            if now - started < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(2 * pause, SLEEP_MAX_S)

    def _fail(self, peer: int, generation: int, what: str) -> NoReturn:
        reached = self._arrived[peer * COUNTER_STRIDE]
        self._broken = (
            f"shared-memory collective: rank {self.rank} of a {self.size}-rank group (world rank "
            f"{self._world_ranks[self.rank]}) waited for rank {peer} (world rank {self._world_ranks[peer]}, "
            f"pid {self._pids[peer]}), which {what}: this was call {generation}, it reached call {reached} "
            "(a rank died, or skipped a collective the others made)"
        )
        raise RuntimeError(self._broken)


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, an exited child its parent has
    not reaped yet, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return not Path("/proc").is_dir()  # no /proc to ask: kill's answer stands
    return state not in ("Z", "X")


def _header_bytes(size: int) -> int:
    return -(-size * COUNTER_STRIDE * 8 // HEADER_ALIGN) * HEADER_ALIGN


def _place() -> tuple[str, int, str]:
    """What ranks sharing a segment must share: the host, its /dev/shm, and the pid namespace (the
    liveness check sends signals to peers' pids)."""
    try:
        shm_device = SHM_DIRECTORY.stat().st_dev
        pid_namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return socket.gethostname(), -1, ""
    return socket.gethostname(), shm_device, pid_namespace


def _new_segment(total: int) -> str:
    """Create a segment of `total` zeroed bytes (space reserved now); its name under /dev/shm."""
    name = f"servelm-shm-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(SHM_DIRECTORY / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError:
        (SHM_DIRECTORY / name).unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return name


def _map(path: Path, total: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != total:
            raise OSError(f"{path} has {os.fstat(fd).st_size} bytes, expected {total}")
        return mmap.mmap(fd, total)
    finally:
        os.close(fd)


def _try(action: Callable[[], T], what: str) -> T | None:
    try:
        return action()
    except OSError as error:
        logger.warning("shared-memory collectives off: could not %s the segment (%s); gloo carries them", what, error)
        return None
