"""A cost profile for hardware not at hand, from its published peaks: an estimate, labelled as one.

For a model (its config.json) on a device (memory bandwidth, dense bfloat16 FLOP/s, memory):

    fixed           every step reads the weights once: weight bytes / bandwidth, + STEP_LAUNCH_S
    decode_tokens   a decode row's matmuls: 2 x active parameters FLOPs
    prompt_tokens   a prompt token's, the same
    decode_context  a decode row reads its context's K/V: KV bytes per token / bandwidth
    chunk_context   a chunk re-reads its cached context's K/V, the same per context token
    prompt_pairs    QK^T and PV per (query, key) pair: 4 x layers x heads x head_dim FLOPs

each at an assumed share of the peak (MATMUL_EFFICIENCY, BANDWIDTH_EFFICIENCY). The KV pool is
what memory holds after the weights (KV_MEMORY_SHARE of it). Nothing here was measured: the
profile's kind is "roofline", and every simulated report is headed "roofline estimate for ...". The published peaks are NVIDIA's datasheet figures (SXM parts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from servelm.models.arch import ModelArchConfig
from servelm.models.plan import count_parameters, kv_bytes, weight_bytes
from servelm.scheduler.step_cost import FEATURES, StepShape
from servelm.simulate.profile import ROOFLINE, CostProfile, EngineShape


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float  # dense, per second
    bandwidth: float  # memory bytes per second
    memory_bytes: float


DEVICES = {
    "h100": Device("NVIDIA H100 SXM", 989e12, 3.35e12, 80e9),
    "h200": Device("NVIDIA H200 SXM", 989e12, 4.8e12, 141e9),
}
# Assumed shares of the peaks a serving step reaches (not measured here: a GPU check on a lent
# device replaces the whole profile with a calibrated one).
MATMUL_EFFICIENCY = 0.6
BANDWIDTH_EFFICIENCY = 0.8
STEP_LAUNCH_S = 0.002  # a step's kernel launches, sampling and scheduling around the forward
KV_MEMORY_SHARE = 0.9  # of the memory left after the weights
BLOCK_SIZE = 16
MAX_MODEL_LEN = 32768  # the context window a replica is given when the model's is longer


def roofline_profile(device_name: str, config: dict[str, Any], model_name: str = "",
                     engine_flags: dict[str, Any] | None = None) -> CostProfile:  # fmt: skip
    """The estimated profile of the model whose config.json is `config` on one device."""
    device = DEVICES.get(device_name.lower())
    if device is None:
        raise ValueError(f"unknown device {device_name!r}; known: {', '.join(sorted(DEVICES))}")
    arch = ModelArchConfig.from_hf_config(config)
    params, weights, kv = count_parameters(arch), weight_bytes(arch).bf16, kv_bytes(arch).stored
    flops = device.bf16_flops * MATMUL_EFFICIENCY
    bandwidth = device.bandwidth * BANDWIDTH_EFFICIENCY
    per_token = 2.0 * params.active / flops
    per_context = kv / bandwidth
    heads_dim = arch.num_attention_heads * arch.head_dim
    coefficients = dict.fromkeys(FEATURES, 0.0) | {
        "fixed": weights / bandwidth + STEP_LAUNCH_S,
        "decode_tokens": per_token,
        "decode_context": per_context,
        "prompt_tokens": per_token,
        "prompt_pairs": 4.0 * arch.num_hidden_layers * heads_dim / flops,
        "chunk_context": per_context,
    }
    values = tuple(coefficients[name] for name in FEATURES)
    free = device.memory_bytes - weights
    if free <= 0:
        raise ValueError(f"{model_name or arch.architecture}'s {weights / 1e9:.0f} GB of weights do not fit one "
                         f"{device.name} ({device.memory_bytes / 1e9:.0f} GB)")  # fmt: skip
    num_blocks = int(KV_MEMORY_SHARE * free // (kv * BLOCK_SIZE))
    max_model_len = min(arch.max_position_embeddings or MAX_MODEL_LEN, MAX_MODEL_LEN, num_blocks * BLOCK_SIZE)
    engine = EngineShape(model_name or arch.architecture, num_blocks, BLOCK_SIZE, max_model_len, 0,
                         dict(engine_flags or {}))  # fmt: skip
    return CostProfile(
        name=device.name, kind=ROOFLINE, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        coefficients=values, step_overhead_s=0.0, row_overhead_s=0.0, request_overhead_s=0.0,
        calibration=tuple((shape, _cost(values, shape)) for shape in _calibration_shapes()), engine=engine,
        notes=(f"estimated from published peaks ({device.bf16_flops / 1e12:.0f} TFLOP/s bf16 dense, "
               f"{device.bandwidth / 1e12:.2f} TB/s) at {MATMUL_EFFICIENCY:.0%} / {BANDWIDTH_EFFICIENCY:.0%} of them, "
               f"{STEP_LAUNCH_S * 1e3:.0f} ms a step around the forward; {params.active / 1e9:.2f}B active "
               f"parameters, {weights / 1e9:.1f} GB of bf16 weights, {kv} KV bytes per token: not measured"),
    )  # fmt: skip


def _calibration_shapes() -> list[StepShape]:
    """The kinds of step the engine's start-up calibration times (worker/warmup.py), as the prior a
    simulated scheduler starts from."""
    shapes = [StepShape(dense_passes=1.0) + StepShape.chunk(n, 0) for n in (16, 32, 64, 128, 192)]
    shapes += [StepShape.decode(1, n) for n in (16, 192, 2048)]
    shapes += [sum((StepShape.decode(1, 16) for _ in range(8)), StepShape())]
    shapes += [StepShape(dense_passes=1.0) + StepShape.chunk(16, depth) for depth in (1024, 4096)]
    return shapes


def _cost(coefficients: tuple[float, ...], shape: StepShape) -> float:
    return sum(c * x for c, x in zip(coefficients, shape.features()))
