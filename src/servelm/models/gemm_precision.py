"""What the many-row matmuls of a CPU float32 model compute in (`--gemm-precision`).

A prompt's prefill (and any step of more than `MAX_BLOCK_ROWS` rows) is compute-bound: its
linear layers are GEMMs over the layer's dense float32 weight. Where the CPU multiplies
bfloat16 natively (AMX, AVX512-BF16) the decoder layers can compute those GEMMs in it, opt-in, the
model staying float32 everywhere else (activations between ops, norms, the KV cache, decode's
attention, the LM head, every few-row matmul of decode):

    float32    the reference: F.linear over the float32 weight (the default; greedy output
               matches Hugging Face transformers)
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
weight (its bf16 copy), made at the first many-row matmul after the weight was loaded (`reset`
drops it when rows are loaded again).
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

from servelm.config import GEMM_PRECISIONS


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


def many_row_gemm(precision: str) -> ManyRowGemm | None:
    """A fresh per-layer GEMM for `precision`; None for float32 (F.linear itself)."""
    if precision == "float32":
        return None
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
