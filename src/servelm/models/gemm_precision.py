"""What the many-row matmuls of a CPU float32 model compute in (`--gemm-precision`).

A prompt's prefill (and any step of more than `MAX_BLOCK_ROWS` rows) is compute-bound: its
linear layers are GEMMs over the layer's dense float32 weight. Where the CPU multiplies
bfloat16 natively (AMX, AVX512-BF16) the decoder layers can compute those GEMMs in it, opt-in, the
model staying float32 everywhere else (activations between ops, norms, the KV cache, decode's
attention, the LM head, every few-row matmul of decode):

    float32    the reference: float32 products and sums (the default; greedy output matches
               Hugging Face transformers), computed by oneDNN over the weight reordered once
               where PyTorch carries oneDNN (`OneDnnFloat32Gemm`, kernels/onednn_gemm.py: its cost
               per row stays flat down to a few rows, which is what makes small prompt chunks
               cheap), else MKL's packed GEMM (`PackedFloat32Gemm`: the weight's panels made once;
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
weight (its bf16 copy, its packed panels), made at the first many-row matmul and again whenever the
weight changed since (another tensor, an in-place write, `reset`): the engine's warm-up prompts
make them, before it lists the tensors to keep resident (worker/host_residency.py). The LM head
stays F.linear (models/factory.py).
"""

from __future__ import annotations

import abc
from typing import Any

import torch
import torch.nn.functional as F

from servelm.config import GEMM_PRECISIONS
from servelm.kernels import mkl_gemm, onednn_gemm


class ManyRowGemm(abc.ABC):
    """x @ W^T over many rows from a layer's float32 weight, in this object's precision, through
    what it derives from the weight once (a bf16 copy, packed panels). The derived form follows the
    weight: it is made again when the weight is another tensor or was written in place since (its
    version counter moved), or after `reset`; a deep copy of the model therefore derives its own."""

    def __init__(self) -> None:
        self._derived: object = None
        # (data_ptr, version, shape) of the weight it came from (the shape: empty tensors share address 0)
        self._derived_from: tuple[int, int, torch.Size] | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K], [N, K] -> [M, N] f32
        # An inference tensor (made under inference_mode) keeps no version: its address and shape only.
        version = -1 if weight.is_inference() else weight._version
        source = (weight.data_ptr(), version, weight.shape)
        derived = self._derived
        if derived is None or source != self._derived_from:
            derived = self._derived = self.derive(weight.detach())
            self._derived_from = source
        return self.multiply(x, derived)

    def reset(self) -> None:
        """Forget what was derived from the weight (its rows are being written again)."""
        self._derived = self._derived_from = None

    @abc.abstractmethod
    def derive(self, weight: torch.Tensor) -> object: ...

    @abc.abstractmethod
    def multiply(self, x: torch.Tensor, derived: Any) -> torch.Tensor: ...


class Bfloat16Gemm(ManyRowGemm):
    def derive(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(torch.bfloat16)  # [N, K]

    def multiply(self, x: torch.Tensor, derived: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), derived).float()


class PackedFloat32Gemm(ManyRowGemm):
    """float32 through MKL's packed panels of the weight (kernels/mkl_gemm.py); an empty weight
    (no rows or no columns: MKL refuses those) through F.linear."""

    def __init__(self, kernel: mkl_gemm.MklPackedGemm) -> None:
        super().__init__()
        self._kernel = kernel

    def derive(self, weight: torch.Tensor) -> mkl_gemm.PackedWeight | torch.Tensor:
        return weight if weight.numel() == 0 else self._kernel.pack(weight)

    def multiply(self, x: torch.Tensor, derived: mkl_gemm.PackedWeight | torch.Tensor) -> torch.Tensor:
        if isinstance(derived, torch.Tensor):
            return F.linear(x, derived)
        return self._kernel.matmul(x.contiguous(), derived)


class OneDnnFloat32Gemm(ManyRowGemm):
    """float32 through oneDNN over the weight reordered once (kernels/onednn_gemm.py); an empty
    weight (no rows or no columns: nothing to reorder) through F.linear."""

    def __init__(self, kernel: onednn_gemm.OneDnnGemm) -> None:
        super().__init__()
        self._kernel = kernel

    def derive(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if weight.numel() == 0 else self._kernel.pack(weight)

    def multiply(self, x: torch.Tensor, derived: torch.Tensor) -> torch.Tensor:
        if not derived.is_mkldnn:
            return F.linear(x, derived)
        return self._kernel.matmul(x.contiguous(), derived)

    def __deepcopy__(self, memo: dict[int, object]) -> OneDnnFloat32Gemm:
        return OneDnnFloat32Gemm(self._kernel)  # a oneDNN tensor has no deep copy: the copy reorders its own


def many_row_gemm(precision: str, dtype: torch.dtype, device: torch.device,
                  pack_float32: bool = True) -> ManyRowGemm | None:  # fmt: skip
    """A fresh per-layer GEMM for `precision` in a model of `dtype` on `device`; None: F.linear
    itself (float32 with neither oneDNN nor MKL, or with `pack_float32` off, or any model not CPU
    float32). float32 prefers oneDNN to MKL's packed panels (kernels/onednn_gemm.py says why)."""
    if precision == "float32":
        if not (pack_float32 and device.type == "cpu" and dtype == torch.float32):
            return None
        onednn = onednn_gemm.load()
        if onednn is not None:
            return OneDnnFloat32Gemm(onednn)
        kernel = mkl_gemm.load()
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
