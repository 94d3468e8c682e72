"""What a model needs before its weights exist: `servelm plan CONFIG` (issue 41, item 6).

From a `config.json` alone (DeepSeek-V3's, Qwen3-MoE's; no weights): the parameters, counted tensor by
tensor from the same table the loader checks a checkpoint against (weights.expected_weight_shapes),
in total and active per token (a token passes through top_k of a sparse layer's routed experts);
the weight bytes per storage dtype (bfloat16, and FP8 with one float32 scale per 128x128 block as
DeepSeek-V3 ships its linear layers); the KV bytes per token as servelm's pool stores them (under
latent attention: the latent and the RoPE key) against full K and V heads; and the smallest layout
of GPUs of a given memory that holds the weights and a given number of KV tokens.

A layout is G GPUs: tensor parallelism TP within a node (attention, dense and shared MLPs, the
embedding and the head split TP ways), data parallelism DP = G / TP for attention (each DP rank holds
its own requests' KV), and the routed experts split over all G (expert parallelism EP = G). Under
latent attention the one latent head cannot be split by heads, so every TP rank holds its DP rank's
whole latent KV (as vLLM and SGLang do); full heads split up to the KV head count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servelm.models.arch import ModelArchConfig
from servelm.models.fp8_blocks import FP8_QUANTIZED_LINEAR
from servelm.models.moe_weights import expert_tensor_names
from servelm.models.weights import expected_weight_shapes

GIB = 1024**3
FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size: one float32 scale per 128 x 128 block


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int  # per token: everything but the routed experts a token does not reach
    routed_experts: int  # all routed experts' parameters, every sparse layer

    @property
    def active_share(self) -> float:
        return self.active / self.total


@dataclass(frozen=True)
class WeightBytes:
    bf16: int  # every tensor in bfloat16
    fp8_block: int  # linear layers' weights FP8 + a float32 scale per 128 x 128 block, the rest bfloat16
    bf16_routed: int  # of bf16, the routed experts' part (what expert parallelism splits)
    fp8_routed: int


@dataclass(frozen=True)
class KVBytes:
    stored: int  # per token, all layers, as servelm's pool stores it (bfloat16)
    full_heads: int  # per token if every head's K and V were stored (bfloat16)
    per_layer_values: int  # values per token and layer, as stored
    full_heads_per_layer_values: int


@dataclass(frozen=True)
class Layout:
    gpus: int
    tp: int
    dp: int  # attention data-parallel ranks; experts split over all gpus (EP = gpus)
    weight_bytes_per_gpu: int
    kv_bytes_per_gpu: int  # for the requested KV tokens per DP rank
    kv_tokens_left_per_dp: int  # KV tokens the rest of a GPU's budget would still hold per DP rank

    @property
    def ep(self) -> int:
        return self.gpus


def load_config(path: str | Path) -> dict[str, Any]:
    """A config.json, or a directory holding one."""
    p = Path(path)
    config: dict[str, Any] = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    return config


def count_parameters(arch: ModelArchConfig) -> ParameterCount:
    shapes = expected_weight_shapes(arch)
    total = sum(math.prod(s) for s in shapes.values())
    routed = sum(math.prod(shapes[n]) for n in _routed_expert_names(arch))
    moe = arch.moe
    inactive = 0 if moe is None else routed * (moe.num_experts - moe.top_k) // moe.num_experts
    return ParameterCount(total, total - inactive, routed)


def weight_bytes(arch: ModelArchConfig) -> WeightBytes:
    shapes = expected_weight_shapes(arch)
    routed = set(_routed_expert_names(arch))
    bf16 = fp8 = bf16_routed = fp8_routed = 0
    for name, shape in shapes.items():
        as_bf16 = 2 * math.prod(shape)
        as_fp8 = _fp8_block_bytes(shape) if FP8_QUANTIZED_LINEAR.match(name) else as_bf16
        bf16, fp8 = bf16 + as_bf16, fp8 + as_fp8
        if name in routed:
            bf16_routed, fp8_routed = bf16_routed + as_bf16, fp8_routed + as_fp8
    return WeightBytes(bf16, fp8, bf16_routed, fp8_routed)


def kv_bytes(arch: ModelArchConfig) -> KVBytes:
    stored = arch.kv_planes * arch.kv_cache_heads * arch.kv_cache_head_dim
    if arch.mla is not None:
        full = arch.num_attention_heads * (arch.mla.qk_head_dim + arch.mla.v_head_dim)
    else:
        full = 2 * arch.num_key_value_heads * arch.head_dim
    layers = arch.num_hidden_layers
    return KVBytes(2 * layers * stored, 2 * layers * full, stored, full)


def layouts(arch: ModelArchConfig, fp8: bool, gpu_memory_bytes: int, kv_tokens: int, *,
            gpus_per_node: int = 8, max_gpus: int = 256, utilization: float = 0.9) -> Iterator[Layout]:  # fmt: skip
    """Every layout of 1, 2, 4, ... max_gpus GPUs (TP a power of two up to a node) that holds the weights
    and `kv_tokens` of KV per DP rank within `utilization` of each GPU's memory, fewest GPUs first."""
    weights, kv = weight_bytes(arch), kv_bytes(arch)
    total, routed = (weights.fp8_block, weights.fp8_routed) if fp8 else (weights.bf16, weights.bf16_routed)
    budget = int(utilization * gpu_memory_bytes)
    gpus = 1
    while gpus <= max_gpus:
        tp = 1
        while tp <= min(gpus, gpus_per_node):
            per_gpu = (total - routed) // tp + -(-routed // gpus)
            kv_split = 1 if arch.mla is not None else min(tp, arch.kv_cache_heads)
            kv_per_token = -(-kv.stored // kv_split)
            kv_needed = kv_tokens * kv_per_token
            if per_gpu + kv_needed <= budget:
                yield Layout(gpus, tp, gpus // tp, per_gpu, kv_needed, (budget - per_gpu) // kv_per_token)
            tp *= 2
        gpus *= 2


def smallest_layout(arch: ModelArchConfig, fp8: bool, gpu_memory_bytes: int, kv_tokens: int, **options: Any) -> Layout | None:
    """The fewest GPUs; among those, the layout that leaves the most KV tokens per DP rank."""
    best: Layout | None = None
    for layout in layouts(arch, fp8, gpu_memory_bytes, kv_tokens, **options):
        if best is not None and layout.gpus > best.gpus:
            break
        if best is None or layout.kv_tokens_left_per_dp * layout.dp > best.kv_tokens_left_per_dp * best.dp:
            best = layout
    return best


def report(config: dict[str, Any], gpu_memory_gib: float, kv_tokens: int, gpus_per_node: int = 8) -> str:
    """The plan as text: parameters, weight bytes, KV bytes per token, smallest layouts."""
    arch = ModelArchConfig.from_hf_config(config)
    params, weights, kv = count_parameters(arch), weight_bytes(arch), kv_bytes(arch)
    shipped_fp8 = (config.get("quantization_config") or {}).get("quant_method") == "fp8"
    memory = int(gpu_memory_gib * GIB)
    lines = [
        f"model: {arch.architecture}, {arch.num_hidden_layers} layers (config only; nothing read but config.json)",
        f"parameters: total {params.total / 1e9:.1f}B, active per token {params.active / 1e9:.1f}B "
        f"({100 * params.active_share:.1f}%)"
        + (f"; routed experts {params.routed_experts / 1e9:.1f}B ({arch.moe.num_experts} per sparse layer, "
           f"top {arch.moe.top_k}, {len(arch.moe.sparse_layers)} sparse layers)" if arch.moe else ""),  # fmt: skip
        f"weights: bfloat16 {weights.bf16 / GIB:.1f} GiB; FP8 block-scaled {weights.fp8_block / GIB:.1f} GiB"
        + (" (as the checkpoint ships)" if shipped_fp8 else ""),
        f"KV per token (bfloat16, all layers): {kv.stored:,} B as servelm stores it ({kv.per_layer_values} values a layer"
        + (f": latent {arch.mla.kv_lora_rank} + RoPE key {arch.mla.qk_rope_head_dim}" if arch.mla else "")
        + f"); full K and V heads would be {kv.full_heads:,} B ({kv.full_heads_per_layer_values} a layer, "
        f"{kv.full_heads / kv.stored:.1f}x)",
        f"layouts on {gpu_memory_gib:g} GiB GPUs ({gpus_per_node} a node, 90% of memory, {kv_tokens:,} KV tokens per DP rank):",
    ]
    for fp8 in (False, True):
        best = smallest_layout(arch, fp8, memory, kv_tokens, gpus_per_node=gpus_per_node)
        name = "FP8 block-scaled" if fp8 else "bfloat16"
        if best is None:
            lines.append(f"  {name}: does not fit 256 GPUs")
            continue
        lines.append(
            f"  {name}: {best.gpus} GPU(s): TP {best.tp} x DP {best.dp}, experts EP {best.ep}; "
            f"weights {best.weight_bytes_per_gpu / GIB:.1f} GiB a GPU, KV {best.kv_bytes_per_gpu / GIB:.2f} GiB; "
            f"room for {best.kv_tokens_left_per_dp:,} KV tokens per DP rank"
        )
    return "\n".join(lines)


def _routed_expert_names(arch: ModelArchConfig) -> list[str]:
    moe = arch.moe
    if moe is None:
        return []
    return [name for layer in sorted(moe.sparse_layers) for expert in range(moe.num_experts)
            for name in expert_tensor_names(moe, f"model.layers.{layer}", expert)]  # fmt: skip


def _fp8_block_bytes(shape: tuple[int, ...]) -> int:
    rows, columns = shape
    return rows * columns + 4 * -(-rows // FP8_BLOCK) * -(-columns // FP8_BLOCK)
