"""A small decode step's decoder layers in one compiled call on CPU (kernels/decode_layers.py).

Op by op, a batch-1 decode step of the default model spends about as long in ~450 small torch ops
and ctypes calls as in reading its weights (benchmarks/decode_step.py). For the steps that dominate
serving latency (every row a decode, few rows, float32 pool, GGUF-block weights) `LlamaForCausalLM`
hands its layer loop to `FusedDecodeLayers`, which runs all of them in one C call; every other step
(prefill chunks, mixed batches, many rows, other weights or pools) keeps the op-by-op path.
The two compute the same float32 values up to the order of the sums inside the norms and the
softmax (tests/models/test_fused_decode.py holds them together; the engine's greedy tests hold the
fused path to the reference).

`FusedDecodeLayers.of(model)` says whether a model can take the path at all (decided once, when the
model is built); `accepts` decides per step. SERVELM_KERNELS=unfused (or =torch) turns it off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from servelm import envs
from servelm.attention.kv_storage import LayerKVCache
from servelm.attention.torch_backend import KernelDecodes, TorchAttentionBackend, TorchAttentionMetadata
from servelm.kernels import cpu as cpu_kernels
from servelm.kernels.decode_layers import (
    BlockMatrix,
    DecodeLayersCall,
    LayerGeometry,
    LayerTensors,
    PreparedLayers,
    StackedLoRA,
    prepare_layers,
)
from servelm.models.linear_methods import MAX_BLOCK_ROWS, BlockLinearMethod
from servelm.models.mla import LatentAttention
from servelm.models.moe import SparseMoE

if TYPE_CHECKING:
    from servelm.models.layers import Linear
    from servelm.models.llama import LlamaForCausalLM

LayerMatrices = tuple[BlockMatrix, BlockMatrix, BlockMatrix, BlockMatrix]  # qkv, o, gate_up, down

# Sets of pools prepared at once: the target's layers and a self-speculative draft's first layers.
MAX_POOL_SETS = 4


def _block_matrix(linear: Linear) -> BlockMatrix | None:
    method = linear.method
    if not isinstance(method, BlockLinearMethod) or linear.reduce is not None:
        return None
    return BlockMatrix(linear.blocks, method.block_type.value, linear.bias)


class FusedDecodeLayers:
    """The model's decoder layers as the `decode_layers` kernel's prepared weights, per KV pool."""

    def __init__(self, model: LlamaForCausalLM, kernel: cpu_kernels.CpuKernels,
                 matrices: list[LayerMatrices]) -> None:  # fmt: skip
        self.model, self.kernel, self.matrices = model, kernel, matrices
        attention = model.decoder_layers[0].self_attn
        arch = model.arch
        mlp = model.decoder_layers[0].mlp
        assert not isinstance(mlp, SparseMoE)  # `of` refuses mixtures of experts
        assert not isinstance(attention, LatentAttention)  # and latent attention
        self.geometry = LayerGeometry(arch.hidden_size, attention.num_heads, attention.num_kv_heads,
                                      attention.head_dim, mlp.intermediate_size,
                                      arch.rms_norm_eps)  # fmt: skip
        self.scale = attention.scale
        self._prepared: dict[tuple[int, ...], PreparedLayers] = {}  # by the pools' data pointers
        self._lora_rows: Callable[[], torch.Tensor | None] | None = None  # each step's rows' adapter slots

    def add_lora(self, stacked: Sequence[tuple[StackedLoRA, StackedLoRA, StackedLoRA, StackedLoRA]],
                 row_slots: Callable[[], torch.Tensor | None]) -> None:  # fmt: skip
        """Adapters stacked by slot for every layer's (qkv, o, gate_up, down) (servelm.lora), and
        where a step finds its rows' slots (None: no adapter rows): the call then adds the adapter
        rows' deltas after each matmul, as the op-by-op path does."""
        self.matrices = [
            (replace(qkv, lora=stacked_qkv), replace(o, lora=stacked_o), replace(gate_up, lora=stacked_gate_up),
             replace(down, lora=stacked_down))
            for (qkv, o, gate_up, down), (stacked_qkv, stacked_o, stacked_gate_up, stacked_down)
            in zip(self.matrices, stacked, strict=True)
        ]  # fmt: skip
        self._lora_rows = row_slots
        self._prepared.clear()

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> FusedDecodeLayers | None:
        """The fused path for `model`, or None where it cannot apply: kernels off or not built, not float32
        on CPU, tensor-parallel, another attention backend, or any linear layer not GGUF blocks."""
        arch = model.arch
        if envs.kernels_mode() is not envs.KernelsMode.AUTO or arch.moe is not None or arch.mla is not None or arch.qk_norm:
            return None  # the fused layers are the plain Llama block's
        kernel = cpu_kernels.load()
        norm = model.norm.weight
        if kernel is None or norm.device.type != "cpu" or norm.dtype != torch.float32 or model.shard.tp.is_parallel:
            return None
        matrices: list[LayerMatrices] = []
        for layer in model.decoder_layers:
            attention = layer.self_attn
            assert not isinstance(attention, LatentAttention)  # refused above
            if not isinstance(attention.backend, TorchAttentionBackend):
                return None
            qkv, o = _block_matrix(attention.qkv_proj), _block_matrix(attention.o_proj)
            mlp = layer.mlp
            assert not isinstance(mlp, SparseMoE)  # refused above otherwise
            gate_up, down = _block_matrix(mlp.gate_up_proj), _block_matrix(mlp.down_proj)
            if qkv is None or o is None or gate_up is None or down is None:
                return None
            matrices.append((qkv, o, gate_up, down))
        return cls(model, kernel, matrices)

    def accepts(self, num_tokens: int, metadata: object, kv_caches: Sequence[LayerKVCache] | None) -> bool:
        """Whether this step goes through the fused call: every token a decode row attended by the paged
        kernel, few enough rows for the block matmul, a float32 pool."""
        if kv_caches is None or num_tokens > MAX_BLOCK_ROWS or not isinstance(metadata, TorchAttentionMetadata):
            return False
        decodes = metadata.decodes
        pool = kv_caches[0]
        return (
            isinstance(decodes, KernelDecodes)
            and decodes.covers_batch
            and metadata.slot_mapping is not None
            and isinstance(pool, torch.Tensor)
            and pool.dtype == torch.float32
        )

    def _prepared_layers(self, kv_caches: Sequence[LayerKVCache]) -> PreparedLayers:
        """The first len(kv_caches) layers over those pools (a self-speculative draft passes its first
        layers' only), prepared once per set of pools: the runner allocates them once."""
        pools = tuple(cache.data_ptr() for cache in kv_caches if isinstance(cache, torch.Tensor))
        prepared = self._prepared.get(pools)
        if prepared is None:
            layers = [
                LayerTensors(qkv, o, gate_up, down, layer.input_layernorm.weight.detach(),
                             layer.post_attention_layernorm.weight.detach(), pool)  # type: ignore[arg-type]
                for layer, (qkv, o, gate_up, down), pool in zip(self.model.decoder_layers, self.matrices, kv_caches)
            ]  # fmt: skip
            if len(self._prepared) >= MAX_POOL_SETS:  # pools replaced: the old pointers are stale
                self._prepared.clear()
            prepared = self._prepared[pools] = prepare_layers(layers, self.geometry)
        return prepared

    def run(
        self,
        hidden: torch.Tensor,  # [B, hidden]: the embedding of the step's tokens (overwritten)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, 1, D/2]
        metadata: TorchAttentionMetadata,  # accepted by `accepts`
        kv_caches: Sequence[LayerKVCache],
        num_layers: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual sum before it), as the layer loop returns them."""
        decodes = metadata.decodes
        assert isinstance(decodes, KernelDecodes) and metadata.slot_mapping is not None
        prepared = self._prepared_layers(kv_caches)
        batch = decodes.batch
        call = DecodeLayersCall(
            prepared, hidden, None, batch.block_tables, batch.seq_lens, batch.max_len, metadata.slot_mapping,
            rope[0], rope[1], self.scale, torch.get_num_threads(),
            self._lora_rows() if self._lora_rows is not None else None,
        )  # fmt: skip
        layers = len(prepared.layers) if num_layers is None else num_layers
        return self.kernel.decode_layers(prepared, call, layers), call.residual
