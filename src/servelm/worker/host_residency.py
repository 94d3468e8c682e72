"""Keeping a CPU engine's weights and KV pool in fast memory while it idles or only decodes.

On a virtual machine the host may treat guest memory that has not been read for a few seconds
as cold (reclaiming, compressing or unmapping it behind the guest); the guest cannot see or stop
that, and the next read of each page pays for bringing it back. Measured on this project's
2-vCPU VM (benchmarks/RESULTS.md): a 63-token prompt's first token took ~100 ms warm, +15-35 ms
after 2 s of idle, +60-85 ms after 10-30 s and +200-250 ms after 60-100 s, all of it in the
matmuls reading the weights (the same GEMMs over a small, cache-resident weight did not slow).
Decode reads only the quantised blocks, so the float32 weights that prefill reads go cold during
a long decode too, and the first prompt after it pays.

Two things keep it from happening:

- huge pages for the engine process's large allocations (`enable_huge_pages`, PyTorch's
  THP_MEM_ALLOC_ENABLE, read once at the process's first allocation): a 2 MiB page is one entry
  where 4 KiB pages were 512, which the host tracks and restores as a unit;
- `HostResidency`: every `interval_s`, one read per 4 KiB page of every CPU tensor the model
  holds (ModelConfig.keep_warm_s, 1 s), and of the KV pool (KV_POOL_WARM_FACTOR times that),
  paid between steps: ~5 ms for the default model's weights, ~18 ms for its 2 GB pool. A pass is
  read in slices of SLICE_BYTES, one per call between steps (the idle engine loop polls its
  inputs between slices), so a request arriving mid-pass waits for one slice, not the pass (a
  voice request's queue time of 14 ms with nothing else running was a whole pool pass).
  A weight oneDNN reordered for prefill (kernels/onednn_gemm.py) is an opaque tensor whose pages
  Python cannot address: it is read whole, by a one-row product, and counts OPAQUE_READ_COST times
  its bytes against the slice (every byte is read, not one a page).

With both, the 63-token prompt after 30 s idle measured within ~10 ms of warm (THP alone: +50 ms).
On a host that never reclaims, the passes cost the same and change nothing.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import InitVar, dataclass, field

import torch

from servelm.kernels import onednn_gemm

PAGE_BYTES = 4096
# The KV pool is touched this many times less often than the weights: it is 3-4x their size for the
# default model, and a cold pool page costs only a prefix-cache hit that reads it; cold weights cost
# every prompt. The weights' interval is short because decode reads only the quantised blocks: after a
# single stream's 128 decode steps (~1.4 s) the next 128-token prompt's first token took 213 ms
# against 172 ms right after a prefill, and 169 ms with the weights read every 0.5 s.
KV_POOL_WARM_FACTOR = 5.0
# Bytes whose pages one call reads at most: ~2 ms on the 2-vCPU VM (a whole 2 GB pool was ~18 ms).
SLICE_BYTES = 256 * 2**20
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's: allocations of 2 MiB and more get madvise(MADV_HUGEPAGE)
# A whole read of an opaque weight against one byte a page: its bytes count this many times over
# against SLICE_BYTES, so that a slice of them takes about as long as a slice of page reads.
OPAQUE_READ_COST = 8
_MAX_DEPTH = 4  # how far below a module's attributes to look for tensors (linear methods' block tensors)


def enable_huge_pages() -> None:
    """Ask PyTorch's CPU allocator for transparent huge pages in this process, unless the user said
    otherwise. Must run before the process's first tensor allocation (PyTorch reads it once)."""
    os.environ.setdefault(THP_ENV, "1")


# Linux's madvise(2) advice that keeps a range on 4 KiB pages.
_MADV_NOHUGEPAGE = 15


def zeros_on_small_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, except that on a CPU with huge pages on (enable_huge_pages) the tensor's pages
    are advised small before anything touches them. For the KV pool: faulting in 2 GiB of huge
    pages on a host whose memory is fragmented (the kernel compacts memory to find each one) took
    4.0 s against 0.7 s on 4 KiB pages, and every server start paid it (2-vCPU AMX Xeon,
    2026-12-06). The huge pages that keep memory warm on a VM are the weights' (module doc)."""
    if device.type != "cpu" or os.environ.get(THP_ENV) != "1":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype, device=device)
    start = tensor.data_ptr()
    first = -(-start // PAGE_BYTES) * PAGE_BYTES  # whole pages inside the allocation only
    end = (start + tensor.numel() * tensor.element_size()) // PAGE_BYTES * PAGE_BYTES
    if end > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_NOHUGEPAGE)  # best effort
    return tensor.zero_()


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _byte_views(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each distinct CPU storage among `tensors`, once, as a flat uint8 tensor over all its bytes
    (of two storages at one address, as views made with `set_` or `frombuffer` can be, the larger);
    tensors without a storage (opaque ones) are left to `_opaque`."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.is_mkldnn:
            continue
        storage = tensor.untyped_storage()
        known = storages.get(storage.data_ptr())
        if storage.nbytes() >= PAGE_BYTES and (known is None or storage.nbytes() > known.nbytes()):
            storages[storage.data_ptr()] = storage
    return [torch.empty(0, dtype=torch.uint8).set_(storage) for storage in storages.values()]


def _opaque(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The oneDNN-reordered weights among `tensors`, each once."""
    found: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if tensor.is_mkldnn:
            found[id(tensor)] = tensor
    return list(found.values())


def _tensors_under(obj: object, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors held by `obj`'s attributes, lists, tuples and dicts, `_MAX_DEPTH` levels down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth >= _MAX_DEPTH or isinstance(obj, (str, bytes, int, float, type)):
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_under(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_under(item, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):  # submodules are walked by modules()
        for item in vars(obj).values():
            yield from _tensors_under(item, depth + 1)


def model_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor `model` holds: parameters, buffers, and those its modules keep in helper objects
    (a quantised layer's blocks, a dense copy for prefill) that `parameters()` does not list."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)
        for name, value in vars(module).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                yield from _tensors_under(value)


@dataclass
class HostResidency:
    """Reads one byte per page of the given CPU tensors every `interval_s`, in slices of at most
    `slice_bytes` a call (`maybe_touch`)."""

    tensors: InitVar[list[torch.Tensor]]  # only their storages are kept (`_views`)
    interval_s: float
    slice_bytes: int = SLICE_BYTES
    _views: list[torch.Tensor] = field(init=False)
    _opaque: list[torch.Tensor] = field(init=False)  # oneDNN-reordered weights, read whole

    @property
    def num_opaque(self) -> int:
        """Opaque weights it reads whole, at least one a call."""
        return len(self._opaque)
    _last_start: float = field(init=False)  # when the last pass started (monotonic)
    _cursor: tuple[int, int] | None = field(init=False, default=None)  # mid-pass: (view, byte offset) next
    num_bytes: int = field(init=False)  # all it keeps warm
    num_page_bytes: int = field(init=False)  # ... of which read a byte a page (the rest: opaque weights, read whole)

    def __post_init__(self, tensors: list[torch.Tensor]) -> None:
        if self.slice_bytes <= 0 or self.slice_bytes % PAGE_BYTES:
            raise ValueError(f"slice_bytes must be a positive multiple of {PAGE_BYTES}, got {self.slice_bytes}")
        tensors = list(tensors)
        # Page-read views, then the opaque weights: a cursor's index runs over both in that order.
        self._views = _byte_views(tensors)
        self._opaque = _opaque(tensors)
        self.num_page_bytes = sum(view.numel() for view in self._views)
        self.num_bytes = self.num_page_bytes + sum(map(onednn_gemm.num_bytes, self._opaque))
        self._last_start = time.monotonic()

    @property
    def in_pass(self) -> bool:
        """A pass has started and not every page has been read yet."""
        return self._cursor is not None

    def touch(self) -> None:
        """A whole pass now (one started and not finished is finished)."""
        if self._cursor is None:
            self._cursor = (0, 0)
        while self._cursor is not None:
            self._touch_slice()

    def has_work(self, now: float | None = None) -> bool:
        """A pass is in progress, or one is due (`interval_s` since the last one started)."""
        now = time.monotonic() if now is None else now
        return self._cursor is not None or now - self._last_start >= self.interval_s

    def maybe_touch(self, now: float | None = None) -> bool:
        """Read the next slice of the pass in progress, or start one when it is due; True if it
        read a slice."""
        now = time.monotonic() if now is None else now
        if not self.has_work(now):
            return False
        if self._cursor is None:
            self._cursor, self._last_start = (0, 0), now
        self._touch_slice()
        return True

    def _touch_slice(self) -> None:
        assert self._cursor is not None
        index, offset = self._cursor
        budget = self.slice_bytes
        num_views, end_index = len(self._views), len(self._views) + len(self._opaque)
        if index < num_views:  # a call reads pages or opaque weights, never both: a slice's cost either way
            while budget > 0 and index < num_views:
                view = self._views[index]
                end = min(view.numel(), offset + budget)
                view[offset:end:PAGE_BYTES].sum()  # a read of each page; the sum is only there to make the read
                budget -= end - offset
                index, offset = (index + 1, 0) if end == view.numel() else (index, end)
        else:
            while budget > 0 and index < end_index:
                weight = self._opaque[index - num_views]
                onednn_gemm.read_all(weight)
                budget -= OPAQUE_READ_COST * onednn_gemm.num_bytes(weight)
                index += 1
        self._cursor = (index, offset) if index < end_index else None
