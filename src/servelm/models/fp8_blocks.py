"""FP8 block-scaled weights as DeepSeek-V3 (and Qwen3's FP8 releases) ship them.

A quantized linear weight `X.weight` [N, K] is stored in float8 e4m3fn with one float32 scale per
block of (block_n x block_k) weights, `X.weight_scale_inv` [ceil(N / block_n), ceil(K / block_k)];
the config says so:

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

The published formula (DeepSeek-V3's `weight_dequant`): w[n, k] = float32(q[n, k]) * s[n // block_n,
k // block_k], a float32 product, stored in the model's dtype. Edge blocks (N or K not a multiple
of the block) are partial: their scale covers the weights that exist. Tensors the checkpoint did not
quantize (embeddings, norms, the router, the LM head) have no `_scale_inv` and come as they are.

`Fp8BlockWeight` is such a weight as read: its codes and scales. `dequantize` applies the formula
(exact: an e4m3 code times a float32 scale is one float32 rounding, the same the formula makes);
the CPU path does that at load, tensor by tensor, so a load holds at most one float32 tensor beside
the model. On CUDA a layer may keep the codes and multiply through the block-scaled GEMM
(kernels/triton/fp8_gemm.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from servelm.models.arch import UnsupportedQuantizationError

FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
# A linear layer's weight inside a decoder layer: what FP8 checkpoints quantize (the router's gate,
# the norms, the embedding and the head stay in higher precision). Loading does not rely on it
# (a weight is FP8 when the checkpoint has its scale); planning and test checkpoints do.
FP8_QUANTIZED_LINEAR = re.compile(
    r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$|model\.layers\.\d+\..*experts\.\d+\.w[123]\.weight$"
)


@dataclass(frozen=True)
class Fp8BlockScheme:
    """The checkpoint's FP8 block layout, from config.json's `quantization_config`."""

    block_n: int  # weight rows per scale
    block_k: int  # weight columns (inputs) per scale

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Fp8BlockScheme | None:
        """None for an unquantized checkpoint; UnsupportedQuantizationError for any scheme but FP8
        e4m3 weights with block scales and dynamic activations (the one DeepSeek-V3 ships)."""
        quantization = config.get("quantization_config")
        if not quantization:
            return None
        method = quantization.get("quant_method")
        if method != "fp8":
            raise UnsupportedQuantizationError(
                f"quantization {method!r} is not supported: servelm loads FP8 block-scaled checkpoints "
                "(quant_method 'fp8' with weight_block_size), GGUF Q4_0/Q4_1/Q8_0, and unquantized ones"
            )
        block = quantization.get("weight_block_size")
        if not block or len(block) != 2 or min(int(b) for b in block) <= 0:
            raise UnsupportedQuantizationError(
                f"FP8 checkpoint without a weight_block_size (found {block!r}): per-tensor FP8 scales are not supported"
            )
        if quantization.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedQuantizationError(f"FP8 format {quantization.get('fmt')!r} is not supported (e4m3 only)")
        if quantization.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedQuantizationError(
                f"FP8 activation scheme {quantization.get('activation_scheme')!r} is not supported (dynamic only)"
            )
        return cls(int(block[0]), int(block[1]))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale tensor's shape for a weight of `shape` [N, K]: one per block, edge blocks partial."""
        return (-(-shape[0] // self.block_n), -(-shape[1] // self.block_k))


@dataclass(frozen=True)
class Fp8BlockWeight:
    """One [N, K] weight as float8 e4m3fn codes and its float32 block scales."""

    codes: torch.Tensor  # [N, K] float8_e4m3fn
    scales: torch.Tensor  # [ceil(N / block_n), ceil(K / block_k)] float32
    scheme: Fp8BlockScheme

    def __post_init__(self) -> None:
        if self.codes.dtype != FP8_DTYPE or self.codes.dim() != 2:
            raise ValueError(
                f"FP8 codes must be a 2-D float8_e4m3fn tensor, got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        expected = self.scheme.scale_shape(tuple(self.codes.shape))
        if tuple(self.scales.shape) != expected:
            raise ValueError(
                f"FP8 weight {tuple(self.codes.shape)} needs scales {expected}, got {tuple(self.scales.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight by the published formula: code x its block's scale, one float32 rounding."""
        n, k = self.codes.shape
        bn, bk = self.scheme.block_n, self.scheme.block_k
        rows_n, cols_k = self.scales.shape
        # Pad to whole blocks, scale each block in place through a [blocks_n, bn, blocks_k, bk] view,
        # cut the padding off. The padding's codes are zeros: they never reach the result.
        weight = torch.zeros(rows_n * bn, cols_k * bk, dtype=torch.float32)
        weight[:n, :k] = self.codes.to(torch.float32)
        weight.view(rows_n, bn, cols_k, bk).mul_(self.scales.to(torch.float32)[:, None, :, None])
        return weight[:n, :k] if (n, k) != weight.shape else weight

    def sliced(self, rows: range | None = None, columns: range | None = None) -> torch.Tensor:
        """A tensor-parallel rank's part, dequantized (float32) and cut: a rank's shard of an FP8
        layer is served dense (the block-scaled GEMM runs on unsharded layers)."""
        dense = self.dequantize()
        if rows is not None:
            dense = dense[rows.start : rows.stop]
        return dense if columns is None else dense[:, columns.start : columns.stop]


def quantize_fp8_blocks(weight: torch.Tensor, scheme: Fp8BlockScheme) -> Fp8BlockWeight:
    """A float weight [N, K] as FP8 codes with one scale per block (amax / 448 per block): how the
    tests and benchmarks make checkpoints in the published layout. Not used to serve."""
    n, k = weight.shape
    bn, bk = scheme.block_n, scheme.block_k
    rows_n, cols_k = scheme.scale_shape((n, k))
    padded = torch.zeros(rows_n * bn, cols_k * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows_n, bn, cols_k, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scales = amax / torch.finfo(FP8_DTYPE).max
    codes = (blocks / scales[:, None, :, None]).view(rows_n * bn, cols_k * bk)[:n, :k].to(FP8_DTYPE)
    return Fp8BlockWeight(codes.contiguous(), scales, scheme)
