"""oneDNN's float32 GEMM over a weight reordered once into its blocked layout, through PyTorch's ops.

Why: a prompt chunk's linear layers are GEMMs x[M, K] @ W^T over the same W every step, and how
much a step costs at small M decides how finely a long prompt can be chunked (the step-time bound,
scheduler/step_pricing.py) before chunking itself costs more than it saves. PyTorch's x86 builds
carry oneDNN (`torch.backends.mkldnn`); `mkldnn::_reorder_linear_weight` lays W out once in the
blocked format oneDNN's kernels read, and `mkldnn::_linear_pointwise` multiplies any M by it,
choosing its kernels by the CPU's instruction set (AVX2, AVX-512, AMX), not by its vendor. Over the
default model's 120 decoder matmuls on a 2-vCPU AMD EPYC (Zen 4, AVX-512; benchmarks/packed_gemm.py,
RESULTS.md): 1.1-1.4 ms a row at every M from 9 to 4,096, where MKL's packed GEMM took 4.0 ms a row
at 16 rows and 1.3-1.6 at 512-2,048. A per-row cost that stays flat at small M is what lets a step
carry a small chunk without paying a large fixed part for it.

The reordered weight is an opaque oneDNN tensor (as many bytes as W, in another order); W itself is
not kept. Where the ops are missing (a build without oneDNN), or a probe multiply disagrees with
F.linear beyond float32 rounding, or `SERVELM_KERNELS=torch`, `load()` returns None and the caller
takes the next path (MKL's packed GEMM, else F.linear; models/gemm_precision.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from servelm import envs
from servelm.kernels.arguments import KernelArgumentError, check_tensor
from servelm.kernels.decided_once import DecidedOnce

logger = logging.getLogger(__name__)


def load() -> OneDnnGemm | None:
    """The oneDNN GEMM, or None where it cannot be used here (module doc). Decided once per process
    (until `reset()`); thread-safe."""
    return _decided.get()


def reset() -> None:
    """Forget `load()`'s answer (tests, tools); objects already handed out keep working."""
    _decided.reset()


def _decide() -> OneDnnGemm | None:
    if envs.kernels_mode() is envs.KernelsMode.TORCH:
        return None
    ops: Any = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    ):
        logger.info("PyTorch has no oneDNN linear ops here: prefill GEMMs take the next path")
        return None
    gemm = OneDnnGemm()
    try:
        _probe(gemm)
    except (RuntimeError, AssertionError) as exc:  # an op that exists but fails or disagrees here
        logger.warning("oneDNN's GEMM failed its probe (%s): prefill GEMMs take the next path", exc)
        return None
    return gemm


def _probe(gemm: OneDnnGemm) -> None:
    """One small product against F.linear: the ops exist in more builds than they work in."""
    with torch.device("cpu"):  # decided inside the model factory's meta-device context, too
        gen = torch.Generator().manual_seed(0)
        weight, x = torch.randn(24, 40, generator=gen), torch.randn(13, 40, generator=gen)
        got, want = gemm.matmul(x, gemm.pack(weight)), F.linear(x, weight)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5), "differs from F.linear"


_decided: DecidedOnce[OneDnnGemm | None] = DecidedOnce(_decide)


class OneDnnGemm:
    """Stateless wrappers of the two ops, checking what reaches them."""

    def __deepcopy__(self, memo: dict[int, object]) -> OneDnnGemm:
        return self  # no state: a copied model shares it

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """W [n, k] float32 (CPU) in oneDNN's blocked layout for x @ W^T; W itself is not kept."""
        weight = check_tensor("weight", weight.detach().contiguous(), torch.float32, 2)
        if weight.shape[0] == 0 or weight.shape[1] == 0:
            raise KernelArgumentError(f"weight: an empty matrix {tuple(weight.shape)} has nothing to reorder")
        with torch.device("cpu"):  # not whatever default device a caller's context set (the model factory's meta)
            return torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def matmul(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x [m, k] float32 @ W^T -> [m, n] float32 (a new tensor)."""
        x = check_tensor("x", x, torch.float32, 2)
        if not packed.is_mkldnn or x.shape[1] != packed.shape[1]:
            raise KernelArgumentError(
                f"x: expected {packed.shape[1]} columns against a weight reordered by pack(), found {x.shape[1]}"
            )
        with torch.device("cpu"):
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def num_bytes(packed: torch.Tensor) -> int:
    """Bytes a reordered weight holds (it has no storage to ask)."""
    return int(torch.ops.mkldnn._nbytes(packed))


def read_all(packed: torch.Tensor) -> None:
    """Read every byte of a reordered weight [n, k]: a product with one row of zeros (the keep-warm
    pass, worker/host_residency.py: its pages cannot be addressed from Python)."""
    with torch.device("cpu"):
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, packed.shape[1]), packed, None, "none", [], "")
