"""`servelm plan` on published config.json files (config only, no weights): DeepSeek-V3 (671B total,
37B active, as its report says) and Qwen3-235B-A22B (235B, 22B), the KV bytes a token takes under
latent attention against full heads, FP8 block-scaled bytes with padded edge blocks, and the
smallest GPU layout, checked against the next smaller one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from servelm.models.arch import ModelArchConfig
from servelm.models.plan import GIB, count_parameters, kv_bytes, layouts, load_config, smallest_layout, weight_bytes

DATA = Path(__file__).parent / "data"


def arch_of(name: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(load_config(DATA / f"{name}_config.json"))


@pytest.mark.parametrize(("name", "total", "active"), [("deepseek_v3", 671e9, 37e9), ("qwen3_235b_a22b", 235e9, 22e9)])
def test_parameters_are_the_published_counts(name: str, total: float, active: float) -> None:
    params = count_parameters(arch_of(name))
    assert params.total == pytest.approx(total, rel=0.01)
    assert params.active == pytest.approx(active, rel=0.03)


def test_latent_kv_is_576_values_a_layer_against_full_heads() -> None:
    arch = arch_of("deepseek_v3")
    kv = kv_bytes(arch)
    assert kv.per_layer_values == 512 + 64 and kv.stored == 61 * 576 * 2
    assert kv.full_heads_per_layer_values == 128 * (192 + 128)  # K heads 192 wide (128 + RoPE 64), V heads 128
    dense = kv_bytes(arch_of("qwen3_235b_a22b"))
    assert dense.stored == dense.full_heads == 94 * 2 * 4 * 128 * 2


def test_fp8_block_bytes_count_a_scale_per_padded_block() -> None:
    arch = arch_of("deepseek_v3")
    weights = weight_bytes(arch)
    # kv_a_proj_with_mqa is 576 x 7168: 5 x 56 blocks (the last row of blocks 64 rows high).
    assert 576 * 7168 + 4 * 5 * 56 < weights.fp8_block
    assert 0.49 < weights.fp8_block / weights.bf16 < 0.51  # ~1 byte a weight, embedding and head in bfloat16
    assert weights.bf16_routed == 2 * count_parameters(arch).routed_experts


@pytest.mark.parametrize("gpu_gib", [80.0, 141.0])
def test_the_smallest_layout_fits_and_half_as_many_gpus_do_not(gpu_gib: float) -> None:
    arch = arch_of("deepseek_v3")
    memory = int(gpu_gib * GIB)
    best = smallest_layout(arch, True, memory, 32768)
    assert best is not None and best.gpus == best.tp * best.dp
    assert best.weight_bytes_per_gpu + best.kv_bytes_per_gpu <= 0.9 * memory
    assert not [layout for layout in layouts(arch, True, memory, 32768) if layout.gpus < best.gpus]
    assert best.gpus == (16 if gpu_gib == 80.0 else 8)  # 627 GiB of FP8 weights, 90% of each GPU


def test_the_command_prints_the_plan() -> None:
    out = subprocess.run([sys.executable, "-m", "servelm.cli", "plan", str(DATA / "deepseek_v3_config.json"),
                          "--gpu-memory-gib", "141"], capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    assert "total 671.0B, active per token 37.6B" in out
    assert "latent 512 + RoPE key 64" in out and "71.1x" in out
    assert "FP8 block-scaled: 8 GPU(s)" in out
