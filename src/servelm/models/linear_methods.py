"""How a linear layer stores its weight and multiplies by it, chosen per layer when the model is built.

After vLLM's `LinearBase.quant_method` (our own, smaller): the model factory looks at how
the checkpoint stores a layer's tensors (without reading them) and gives the layer a method;
the layer asks its method to create its parameters, to load each checkpoint tensor into its
rows, and to compute x @ W^T + b. No attribute is bolted on afterwards.

    DenseLinearMethod       weight [N, K] in the model dtype; F.linear.
    Int8BlockLinearMethod   GGUF Q4_1 / Q8_0 layers, CPU float32 only: int8 codes + per-32
                            scales (+ offsets) for few-row matmuls (the `qgemm_small` kernel
                            reads under a third of the bytes), and the same weights dequantised
                            to dense float32 for many-row matmuls (MKL's blocked GEMM wins there).

Both paths multiply by bit-identical float32 weights (see int8_blocks.py); only the
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
from servelm.models.int8_blocks import BLOCK, Int8BlockWeight
from servelm.models.weights import Storage, TensorInfo, Weight, dense_tensor

if TYPE_CHECKING:
    from servelm.models.llama import Linear

# Above this many rows a matmul is compute-bound and MKL's blocked float32 GEMM wins.
MAX_INT8_ROWS = 8


def small_batch_kernel() -> Any:
    """The compiled CPU kernels holding `qgemm_small`, or None where they cannot be built here."""
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
    """The weight as one dense matrix [N, K] in the model's dtype (int8 blocks are dequantised on load)."""

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))

    def load_rows(self, layer: Linear, weight: Weight, row_offset: int) -> None:
        dense = dense_tensor(weight)
        layer.weight[row_offset : row_offset + dense.shape[0]].copy_(dense)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class Int8BlockLinearMethod(DenseLinearMethod):
    """Int8 codes for few-row matmuls plus their dense float32 weight for many-row ones (CPU, float32).

    `with_mins`: the layer keeps per-block offsets (some part is Q4_1); a part without them
    (Q8_0) gets offsets of -0.0, which change no bit of any weight (int8_blocks.py).
    """

    def __init__(self, with_mins: bool) -> None:
        self.with_mins = with_mins
        self._prepared_weight: Any = None  # the kernel's checked handle of the layer's weight

    def create_weights(self, layer: Linear) -> None:
        super().create_weights(layer)  # dense float32 weight, [N, K], for the GEMM path
        n, k = layer.out_features, layer.in_features
        if k % BLOCK:
            raise ValueError(f"int8 block weights need in_features divisible by {BLOCK}, got {k}")
        layer.register_buffer("codes", torch.empty(n, k, dtype=torch.int8), persistent=False)  # [N, K]
        layer.register_buffer("scales", torch.empty(n, k // BLOCK), persistent=False)  # [N, K / 32]
        mins = torch.empty(n, k // BLOCK) if self.with_mins else None
        layer.register_buffer("mins", mins, persistent=False)  # [N, K / 32] or None

    def load_rows(self, layer: Linear, weight: Weight, row_offset: int) -> None:
        if not isinstance(weight, Int8BlockWeight):
            raise TypeError(f"Int8BlockLinearMethod loads Int8BlockWeight parts, got a {type(weight).__name__}")
        if weight.mins is not None and not self.with_mins:
            raise ValueError("a part with per-block offsets (Q4_1) in a layer built without them")
        rows = slice(row_offset, row_offset + weight.shape[0])
        self._prepared_weight = None  # the kernel's handle is made again from the loaded tensors
        layer.codes[rows].copy_(weight.codes)
        layer.scales[rows].copy_(weight.scales)
        if layer.mins is not None:  # the layer keeps offsets (with_mins)
            if weight.mins is None:
                layer.mins[rows].fill_(-0.0)
            else:
                layer.mins[rows].copy_(weight.mins)
        # A tied head writes the embedding's matrix here: the same values the embedding holds.
        weight.dequantize(out=layer.weight[rows])

    def _prepared(self, layer: Linear, kernel: Any) -> Any:
        """The layer's weight as the kernel's checked handle: one per method instance (the factory
        makes one per layer), made on first use and dropped by load_rows. It holds the tensors it
        checked, so a layer whose buffers were later replaced wholesale would keep reading the old
        (still alive, never garbage) ones: int8 layers live on CPU in float32 and are not moved."""
        prepared = self._prepared_weight
        if prepared is None:
            prepared = self._prepared_weight = kernel.prepare_int8_weight(layer.codes, layer.scales, layer.mins)
        return prepared

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= MAX_INT8_ROWS and x.dtype == torch.float32:
            # None once SERVELM_KERNELS=torch turned the kernels off after the model was built.
            kernel = small_batch_kernel()
            if kernel is not None:
                out = kernel.qgemm_prepared(x.contiguous(), self._prepared(layer, kernel))
                return out if layer.bias is None else out + layer.bias
        return F.linear(x, layer.weight, layer.bias)


DENSE = DenseLinearMethod()

# Given the checkpoint prefixes a linear layer's weight is made of (one, or the fused parts
# such as q/k/v) and the input columns this rank keeps of them (None: all; a row-parallel
# layer's shard), the method to build it with. The model calls it once per linear layer.
LinearMethodChooser = Callable[[Sequence[str], range | None], LinearMethod]


def all_dense(parts: Sequence[str], columns: range | None = None) -> LinearMethod:
    return DENSE


def choose_linear_method(parts: Sequence[TensorInfo], dtype: torch.dtype, device: torch.device) -> LinearMethod:
    """Int8 blocks when every part of the layer is stored as int8 blocks and the model runs on CPU in
    float32 with the kernel built; dense otherwise (another device or dtype, or a part that is F32 /
    F16 / a K-quant, where no exact int8 form exists)."""
    storages = {part.storage for part in parts}
    if Storage.DENSE in storages or device.type != "cpu" or dtype != torch.float32 or small_batch_kernel() is None:
        return DENSE
    return Int8BlockLinearMethod(with_mins=Storage.INT8_BLOCKS_WITH_MINS in storages)
