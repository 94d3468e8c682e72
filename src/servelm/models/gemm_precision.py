"""What the many-row matmuls of a CPU float32 model compute in (`--gemm-precision`).

A prompt's prefill (and any step of more than `MAX_BLOCK_ROWS` rows) is compute-bound: its
linear layers are GEMMs over the layer's dense float32 weight. Where the CPU multiplies
bfloat16 natively (AMX, AVX512-BF16) the decoder layers can compute those GEMMs in it, opt-in, the
model staying float32 everywhere else (activations between ops, norms, the KV cache, decode's
attention, the LM head, every few-row matmul of decode):

    float32    the reference: float32 products and sums (the default; greedy output matches
               Hugging Face transformers), computed by MKL's packed GEMM where PyTorch carries
               MKL (`PackedFloat32Gemm`: the weight's panels made once, not on every call;
               kernels/mkl_gemm.py), else F.linear
    bfloat16   inputs and weight rounded to bfloat16 (8-bit mantissa), products accumulated in
               float32 by oneDNN (AMX tiles where the CPU has them), the result float32; prefill
               chunks' attention likewise (SDPA on q, k, v in bfloat16: its two GEMMs are most
               of a long prompt's prefill; attention/torch_backend.py)

Its logit error and speed on the default model are in benchmarks/RESULTS.md
(benchmarks/gemm_precision.py makes them). int8 (each row of the input and of the weight scaled
to int8, an int8 GEMM, rescaled) was measured and left out: on the default model its mean
|logit error| was 0.75, several times bfloat16's, because per-row scales of an LLM's activations
are set by their few outlier channels. A narrower GEMM changes the numbers a prompt's KV holds,
so it is part of the KV fingerprint that shared KV tiers check.

Each layer gets its own `ManyRowGemm`, which keeps what it derives from the layer's float32
weight (its bf16 copy, its packed panels), made at the first many-row matmul after the weight was
loaded (`reset` drops it when rows are loaded again): the engine's warm-up prompts make them, before
it lists the tensors to keep resident (worker/host_residency.py).
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

from servelm.config import GEMM_PRECISIONS
from servelm.kernels import mkl_gemm


class ManyRowGemm(abc.ABC):
    """x @ W^T over many rows from a layer's float32 weight, in this object's precision."""

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...  # [M, K], [N, K] -> [M, N] f32

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget what was derived from the weight (its rows are being written again)."""


class Bfloat16Gemm(ManyRowGemm):
    def __init__(self) -> None:
        self._weight: torch.Tensor | None = None  # [N, K] bfloat16

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._weight is None:
            self._weight = weight.detach().to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self._weight).float()

    def reset(self) -> None:
        self._weight = None


class PackedFloat32Gemm(ManyRowGemm):
    """float32 through MKL's packed panels of the weight (kernels/mkl_gemm.py)."""

    def __init__(self, kernel: mkl_gemm.MklPackedGemm) -> None:
        self._kernel = kernel
        self._packed: mkl_gemm.PackedWeight | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            self._packed = self._kernel.pack(weight)
        return self._kernel.matmul(x.contiguous(), self._packed)

    def reset(self) -> None:
        self._packed = None


def many_row_gemm(precision: str, dtype: torch.dtype, device: torch.device) -> ManyRowGemm | None:
    """A fresh per-layer GEMM for `precision` in a model of `dtype` on `device`; None: F.linear
    itself (float32 without MKL, or any model not CPU float32)."""
    if precision == "float32":
        kernel = mkl_gemm.load() if device.type == "cpu" and dtype == torch.float32 else None
        return None if kernel is None else PackedFloat32Gemm(kernel)
    if precision == "bfloat16":
        return Bfloat16Gemm()
    raise ValueError(f"unknown gemm precision {precision!r}; valid: {', '.join(GEMM_PRECISIONS)}")


def check_gemm_precision(precision: str, dtype: torch.dtype, device: torch.device) -> None:
    """A narrower GEMM is for CPU float32 models only: elsewhere the model's dtype says it (--dtype)."""
    if precision not in GEMM_PRECISIONS:
        raise ValueError(f"unknown gemm precision {precision!r}; valid: {', '.join(GEMM_PRECISIONS)}")
    if precision != "float32" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"gemm precision {precision} applies to float32 models on CPU; this one is {dtype} on {device.type} "
            "(there, --dtype sets what every matmul computes in)"
        )
