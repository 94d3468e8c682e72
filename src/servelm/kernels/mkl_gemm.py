"""MKL's packed float32 GEMM, from the BLAS that PyTorch's CPU library already carries.

Why: a prompt's linear layers on CPU are GEMMs x[M, K] @ W^T over the same W every step.
`cblas_sgemm` (what `F.linear` runs) copies W into its blocked panel layout on every call; at a
voice or chat prompt's M (tens to a few hundred rows) against the default model's K = 576 that
copy is a large share of the call. `cblas_sgemm_pack` makes the panels once per weight and
`cblas_sgemm_compute` multiplies any M by them, with the same kernels (the sums' order may differ
from `cblas_sgemm`'s, as between any two BLAS calls). Over the default model's 120 decoder matmuls
(2 Intel vCPUs, AMX): 0.72x F.linear's time at 16 rows, 0.83x at 159, 0.94x at 512, 1.00x at
2,048 (benchmarks/RESULTS.md, "Packed float32 GEMMs"; benchmarks/packed_gemm.py).

PyTorch's own `torch.ops.mkl._mkl_linear` uses a packed weight only when M equals the row count
it was packed for (else it falls back to `F.linear`), which a prompt's M never reliably is, hence
the direct call. The symbols come from `libtorch_cpu` (PyTorch's x86 builds link MKL into it);
where they are missing (other platforms, builds without MKL) or `SERVELM_KERNELS=torch`, `load()`
returns None and the caller keeps `F.linear`.

The packed buffer is allocated at `cblas_sgemm_pack_get_size`'s answer, several times the
weight's bytes on this host, of which MKL writes about the weight's own size (1.0-1.3x): the
pages never written are never backed by memory (reading them maps the zero page).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from servelm import envs
from servelm.kernels.arguments import KernelArgumentError, check_int, check_tensor
from servelm.kernels.decided_once import DecidedOnce

logger = logging.getLogger(__name__)

# CBLAS enum values (mkl_cblas.h).
_ROW_MAJOR = 101
_NO_TRANS, _TRANS, _PACKED = 111, 112, 151
_B_MATRIX = 162
# The row count the panels are packed for: MKL uses it only as a hint (any M computes correctly
# against them, tests/kernels/test_mkl_gemm.py); a prompt chunk's typical size.
_PACK_ROWS_HINT = 512


@dataclass(frozen=True)
class PackedWeight:
    """A weight W [n, k] as MKL's panels for x @ W^T; `buffer` owns them (uint8, opaque). The
    panels hold addresses inside the buffer: a copy of it (a deep copy, a pickle) is garbage, so
    `matmul` refuses a buffer that is not at the `address` it was packed at."""

    buffer: torch.Tensor
    address: int
    n: int
    k: int


def load() -> MklPackedGemm | None:
    """The packed GEMM, or None where MKL's symbols are missing or SERVELM_KERNELS=torch.
    Decided once per process (until `reset()`); thread-safe."""
    return _decided.get()


def reset() -> None:
    """Forget `load()`'s answer (tests, tools); objects already handed out keep working."""
    _decided.reset()


def _decide() -> MklPackedGemm | None:
    if envs.kernels_mode() is envs.KernelsMode.TORCH:
        return None
    if not torch.backends.mkl.is_available():
        logger.info("PyTorch has no MKL here: prefill GEMMs use F.linear")
        return None
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return MklPackedGemm(ctypes.CDLL(str(library)))
    except (OSError, AttributeError) as exc:  # no such library / no such symbol
        logger.info("MKL's packed GEMM unavailable (%s): prefill GEMMs use F.linear", exc)
        return None


_decided: DecidedOnce[MklPackedGemm | None] = DecidedOnce(_decide)


class MklPackedGemm:
    """ctypes bindings of MKL's cblas_sgemm_pack / _compute. Holds no state besides the library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        c_int, ptr, f32 = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        lib.cblas_sgemm_pack_get_size.argtypes = [c_int] * 4
        lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
        lib.cblas_sgemm_pack.argtypes = [c_int] * 6 + [f32, ptr, c_int, ptr]
        lib.cblas_sgemm_pack.restype = None
        lib.cblas_sgemm_compute.argtypes = [c_int] * 6 + [ptr, c_int, ptr, c_int, f32, ptr, c_int]
        lib.cblas_sgemm_compute.restype = None
        self._lib = lib

    def __deepcopy__(self, memo: dict[int, object]) -> MklPackedGemm:
        return self  # no state but the process's library: a copied model shares it

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """W [n, k] float32 (contiguous, CPU) as panels for x @ W^T; W itself is not kept."""
        weight = check_tensor("weight", weight.detach(), torch.float32, 2)
        n = check_int("weight rows", weight.shape[0], minimum=1)  # MKL faults on an empty matrix
        k = check_int("weight columns", weight.shape[1], minimum=1)
        _check_fits_c_int("weight rows", n)
        _check_fits_c_int("weight columns", k)
        size = self._lib.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS_HINT, n, k)
        # device: not whatever default device a caller's context set (a meta or CUDA pointer here crashes)
        buffer = torch.empty(size, dtype=torch.uint8, device="cpu")
        self._lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS_HINT, n, k, 1.0,
                                   weight.data_ptr(), k, buffer.data_ptr())  # fmt: skip
        return PackedWeight(buffer, buffer.data_ptr(), n, k)

    def matmul(self, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        """x [m, k] float32 @ W^T -> [m, n] float32 (a new tensor)."""
        x = check_tensor("x", x, torch.float32, 2)
        m, k = x.shape
        if k != packed.k:
            raise KernelArgumentError(f"x: expected {packed.k} columns (the packed weight's k), found {k}")
        if packed.buffer.data_ptr() != packed.address:
            raise KernelArgumentError("packed: the panels were copied or moved after packing; pack the weight again")
        _check_fits_c_int("x rows", m)
        out = torch.empty(m, packed.n, dtype=torch.float32, device="cpu")
        if m:
            self._lib.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, packed.n, k, x.data_ptr(), k,
                                          packed.buffer.data_ptr(), packed.n, 0.0, out.data_ptr(), packed.n)  # fmt: skip
        return out


def _check_fits_c_int(name: str, size: int) -> None:
    """MKL's LP64 interface takes each dimension as a C int: 2**31 or more would wrap."""
    if size >= 2**31:
        raise KernelArgumentError(f"{name}: {size}, more than MKL's 32-bit dimensions hold")
