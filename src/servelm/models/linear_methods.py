"""How a linear layer stores its weight and multiplies by it, chosen per layer when the model is built.

After vLLM's `LinearBase.quant_method` (our own, smaller): the model factory looks at how
the checkpoint stores a layer's tensors (without reading them) and gives the layer a method;
the layer asks its method to create its parameters, to load each checkpoint tensor into its
rows, and to compute x @ W^T + b. No attribute is bolted on afterwards.

    DenseLinearMethod   weight [N, K] in the model dtype; F.linear.
    BlockLinearMethod   GGUF Q4_0 / Q4_1 / Q8_0 layers, CPU float32 only: the file's blocks for
                        few-row matmuls (the `block_gemm_small` kernel reads 0.56-1.06 bytes per
                        weight instead of 4), and the same weights dequantised to dense float32 for
                        many-row matmuls (MKL's blocked GEMM wins there).
    Fp8BlockLinearMethod  FP8 block-scaled layers (fp8_blocks.py) on CUDA: the codes and scales as
                        the checkpoint has them, multiplied by the Triton block-scaled GEMM. On CPU
                        FP8 layers are dense: dequantised at load.

On a CPU float32 model either computes its many-row matmuls through MKL's packed panels of the
weight (float32, the default), or in bfloat16 (`--gemm-precision`, opt-in): gemm_precision.py.

Both paths multiply by bit-identical float32 weights (see gguf_blocks.py); only the
summation order differs, as it does between any two BLAS kernels.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from servelm.kernels import cpu as cpu_kernels
from servelm.models.fp8_blocks import Fp8BlockWeight
from servelm.models.gemm_precision import ManyRowGemm, many_row_gemm
from servelm.models.gguf_blocks import BLOCK, BlockType, BlockWeight
from servelm.models.weights import Storage, TensorInfo, Weight, dense_tensor

if TYPE_CHECKING:
    from servelm.models.layers import Linear

# Above this many rows a matmul is compute-bound and MKL's blocked float32 GEMM wins.
MAX_BLOCK_ROWS = 8


def small_batch_kernel() -> Any:
    """The compiled CPU kernels holding `block_gemm_small`, or None where they cannot be built here."""
    return cpu_kernels.load()


class LinearMethod(abc.ABC):
    """Storage and matmul of one `Linear` layer.

    Contract (all three are called by `Linear`, in the engine process):
    - `create_weights(layer)` once, from the layer's constructor (on the meta device when the
      factory builds the model): registers the layer's parameters / buffers, uninitialised.
    - `load_rows(layer, weight, row_offset)` once per checkpoint tensor, under no_grad, after
      the storage exists on its device: writes rows [row_offset, row_offset + N) of the layer's
      (possibly fused) weight, converting to the storage's dtype/device. Calling it twice
      writes the same rows twice.
    - `apply(layer, x)` on every forward: x [T, K] -> x @ W^T (+ bias) [T, N]; changes nothing.
    """

    @abc.abstractmethod
    def create_weights(self, layer: Linear) -> None: ...

    @abc.abstractmethod
    def load_rows(self, layer: Linear, weight: Weight, row_offset: int) -> None: ...

    @abc.abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinearMethod(LinearMethod):
    """The weight as one dense matrix [N, K] in the model's dtype (blocks are dequantised on load).

    `gemm`: what matmuls over more than MAX_BLOCK_ROWS rows compute in (gemm_precision.py; a CPU
    float32 model's `--gemm-precision`), one per layer; None: F.linear in the model's dtype."""

    def __init__(self, gemm: ManyRowGemm | None = None) -> None:
        self.gemm = gemm

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))

    def load_rows(self, layer: Linear, weight: Weight, row_offset: int) -> None:
        dense = dense_tensor(weight)
        layer.weight[row_offset : row_offset + dense.shape[0]].copy_(dense)
        if self.gemm is not None:
            self.gemm.reset()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None and x.dim() == 2 and x.shape[0] > MAX_BLOCK_ROWS:
            out = self.gemm(x, layer.weight)
            return out if layer.bias is None else out.add_(layer.bias)
        return F.linear(x, layer.weight, layer.bias)


class BlockLinearMethod(DenseLinearMethod):
    """GGUF blocks of one type for few-row matmuls plus their dense float32 weight for many-row ones
    (CPU, float32). Every part of the layer is stored as `block_type` (the chooser sees to it)."""

    def __init__(self, block_type: BlockType, gemm: ManyRowGemm | None = None) -> None:
        super().__init__(gemm)
        self.block_type = block_type
        self._prepared_weight: Any = None  # the kernel's checked handle of the layer's blocks

    def create_weights(self, layer: Linear) -> None:
        super().create_weights(layer)  # dense float32 weight, [N, K], for the GEMM path
        n, k = layer.out_features, layer.in_features
        if k % BLOCK:
            raise ValueError(f"GGUF block weights need in_features divisible by {BLOCK}, got {k}")
        blocks = torch.empty(n, k // BLOCK, self.block_type.block_bytes, dtype=torch.uint8)
        layer.register_buffer("blocks", blocks, persistent=False)  # [N, K / 32, block bytes]

    def load_rows(self, layer: Linear, weight: Weight, row_offset: int) -> None:
        if not isinstance(weight, BlockWeight) or weight.block_type is not self.block_type:
            found = weight.block_type.name if isinstance(weight, BlockWeight) else type(weight).__name__
            raise TypeError(
                f"a {self.block_type.name} BlockLinearMethod loads {self.block_type.name} blocks, got {found}"
            )
        rows = slice(row_offset, row_offset + weight.shape[0])
        self._prepared_weight = None  # the kernel's handle is made again from the loaded tensors
        layer.blocks[rows].copy_(weight.blocks)
        # A tied head writes the embedding's matrix here: the same values the embedding holds.
        weight.dequantize(out=layer.weight[rows])
        if self.gemm is not None:
            self.gemm.reset()

    def _prepared(self, layer: Linear, kernel: Any) -> Any:
        """The layer's blocks as the kernel's checked handle: one per method instance (the factory
        makes one per layer), made on first use and dropped by load_rows. It holds the tensor it
        checked, so a layer whose buffer was later replaced wholesale would keep reading the old
        (still alive, never garbage) one: block layers live on CPU in float32 and are not moved."""
        prepared = self._prepared_weight
        if prepared is None:
            prepared = self._prepared_weight = kernel.prepare_block_weight(layer.blocks, self.block_type.value)
        return prepared

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= MAX_BLOCK_ROWS and x.dtype == torch.float32:
            # None once SERVELM_KERNELS=torch turned the kernels off after the model was built.
            kernel = small_batch_kernel()
            if kernel is not None:
                out = kernel.block_gemm_prepared(x.contiguous(), self._prepared(layer, kernel))
                return out if layer.bias is None else out.add_(layer.bias)
        return super().apply(layer, x)


class Fp8BlockLinearMethod(LinearMethod):
    """FP8 e4m3 codes [N, K] and float32 scales per (block_n x block_k) block, multiplied by the
    Triton block-scaled GEMM (kernels/triton/fp8_gemm.py) in the activations' dtype. Fused parts
    (q/k/v, gate/up) stack their scale rows, so every part's row count is a multiple of block_n
    (the chooser sees to it). The codes are a uint8 buffer (a float8 one would be cast with the
    model's dtype); the scales are made at the first load on the codes' device and stay float32."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block_n, self.block_k = block
        self.scales: torch.Tensor | None = None  # [ceil(N / block_n), ceil(K / block_k)] float32

    def create_weights(self, layer: Linear) -> None:
        codes = torch.empty(layer.out_features, layer.in_features, dtype=torch.uint8)
        layer.register_buffer("codes", codes, persistent=False)  # the e4m3 codes' bytes

    def load_rows(self, layer: Linear, weight: Weight, row_offset: int) -> None:
        if not isinstance(weight, Fp8BlockWeight) or (weight.scheme.block_n, weight.scheme.block_k) != (
            self.block_n,
            self.block_k,
        ):
            raise TypeError(
                f"an FP8 {self.block_n}x{self.block_k} block method loads such FP8 weights, got {type(weight).__name__}"
            )
        if row_offset % self.block_n:
            raise ValueError(f"FP8 part rows start at {row_offset}, not on a {self.block_n}-row scale block")
        if self.scales is None:
            shape = (-(-layer.out_features // self.block_n), -(-layer.in_features // self.block_k))
            self.scales = torch.zeros(shape, dtype=torch.float32, device=layer.codes.device)
        rows = slice(row_offset, row_offset + weight.shape[0])
        layer.codes[rows].copy_(weight.codes.view(torch.uint8))
        first = row_offset // self.block_n
        self.scales[first : first + weight.scales.shape[0]].copy_(weight.scales)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        from servelm.kernels.triton.fp8_gemm import fp8_block_gemm  # Triton is imported where it runs

        assert self.scales is not None, "an FP8 layer multiplies only once loaded"
        shape = x.shape
        codes = layer.codes.view(torch.float8_e4m3fn)
        out = fp8_block_gemm(x.reshape(-1, shape[-1]), codes, self.scales, self.block_n, self.block_k)
        out = out.reshape(*shape[:-1], layer.out_features)
        return out if layer.bias is None else out.add_(layer.bias)


DENSE = DenseLinearMethod()

# Given the checkpoint prefixes a linear layer's weight is made of (one, or the fused parts
# such as q/k/v) and the input columns this rank keeps of them (None: all; a row-parallel
# layer's shard), the method to build it with. The model calls it once per linear layer.
LinearMethodChooser = Callable[[Sequence[str], range | None], LinearMethod]


def all_dense(parts: Sequence[str], columns: range | None = None) -> LinearMethod:
    return DENSE


def choose_linear_method(parts: Sequence[TensorInfo], dtype: torch.dtype, device: torch.device,
                         gemm_precision: str = "float32", pack_float32: bool = True) -> LinearMethod:  # fmt: skip
    """FP8 codes when every part is FP8 block-scaled alike and the model runs on CUDA; GGUF blocks
    when every part of the layer is stored as blocks of one type and the model runs on
    CPU in float32 with the kernel built; dense otherwise (another device or dtype, parts stored
    differently, or a part that is F32 / F16 / a K-quant: no block form the kernel reads).
    `gemm_precision`: what its many-row matmuls compute in (gemm_precision.check_gemm_precision
    has said it suits the dtype and device); `pack_float32`: float32 ones over the weight laid out
    once for oneDNN or MKL where either is here (gemm_precision.many_row_gemm)."""
    storages = {part.storage for part in parts}
    fp8_blocks = {part.fp8_block for part in parts}
    if storages == {Storage.FP8_BLOCK} and len(fp8_blocks) == 1 and device.type == "cuda":
        block = next(iter(fp8_blocks))
        assert block is not None  # FP8_BLOCK infos carry their block
        if all(part.shape[0] % block[0] == 0 for part in parts[:-1]):  # stacked parts start on a scale row
            return Fp8BlockLinearMethod(block)
    block_type = next(iter(storages)).block_type if len(storages) == 1 else None
    if block_type is None or device.type != "cpu" or dtype != torch.float32 or small_batch_kernel() is None:
        return dense_method(dtype, device, gemm_precision, pack_float32)
    return BlockLinearMethod(block_type, many_row_gemm(gemm_precision, dtype, device, pack_float32))


def dense_method(dtype: torch.dtype, device: torch.device, gemm_precision: str = "float32",
                 pack_float32: bool = True) -> LinearMethod:  # fmt: skip
    """The dense method whose many-row matmuls compute in `gemm_precision` for a model of `dtype` on
    `device`: one per layer where that derives something from the layer's weight (it keeps it),
    else the shared DENSE (F.linear)."""
    gemm = many_row_gemm(gemm_precision, dtype, device, pack_float32)
    return DENSE if gemm is None else DenseLinearMethod(gemm)
