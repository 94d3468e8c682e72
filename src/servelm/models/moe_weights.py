"""Where a mixture-of-experts checkpoint keeps its experts' tensors, and their shapes, per family
(Mixtral: `block_sparse_moe.experts.E.w1/w3/w2`; Qwen2-MoE and Qwen3-MoE: `mlp.experts.E.gate_proj/
up_proj/down_proj`, Qwen2-MoE's shared expert `mlp.shared_expert.*` and its `mlp.shared_expert_gate`;
DeepSeek-V2 and V3: the same experts, their shared experts `mlp.shared_experts.*` with no gate, and
V3's router's `mlp.gate.e_score_correction_bias`).
"""

from __future__ import annotations

from servelm.models.arch import DEEPSEEK_NAMINGS, ModelArchConfig, MoEConfig


def expert_tensor_names(moe: MoEConfig, prefix: str, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) weight names of one expert of layer `prefix` ("model.layers.3")."""
    if moe.naming == "mixtral":
        base = f"{prefix}.block_sparse_moe.experts.{expert}"
        return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
    base = f"{prefix}.mlp.experts.{expert}"
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


def shared_expert_prefix(moe: MoEConfig, prefix: str) -> str:
    """Where a layer's shared expert keeps its gate/up/down projections."""
    return f"{prefix}.mlp.shared_experts" if moe.naming in DEEPSEEK_NAMINGS else f"{prefix}.mlp.shared_expert"


def routing_bias_name(prefix: str) -> str:
    """DeepSeek-V3's per-expert bias added to the scores when choosing (not when weighting)."""
    return f"{prefix}.mlp.gate.e_score_correction_bias"


def router_tensor_name(moe: MoEConfig, prefix: str) -> str:
    return f"{prefix}.block_sparse_moe.gate.weight" if moe.naming == "mixtral" else f"{prefix}.mlp.gate.weight"


def moe_weight_shapes(arch: ModelArchConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every tensor a sparse layer's experts read, by checkpoint name."""
    moe = arch.moe
    assert moe is not None
    hidden, width = arch.hidden_size, moe.expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {router_tensor_name(moe, prefix): (moe.num_experts, hidden)}
    for expert in range(moe.num_experts):
        gate, up, down = expert_tensor_names(moe, prefix, expert)
        shapes.update({gate: (width, hidden), up: (width, hidden), down: (hidden, width)})
    if moe.scoring == "sigmoid":
        shapes[routing_bias_name(prefix)] = (moe.num_experts,)
    if moe.shared_expert_intermediate_size:
        shared = moe.shared_expert_intermediate_size
        base = shared_expert_prefix(moe, prefix)
        shapes.update({f"{base}.gate_proj.weight": (shared, hidden), f"{base}.up_proj.weight": (shared, hidden),
                       f"{base}.down_proj.weight": (hidden, shared)})  # fmt: skip
        if moe.naming == "qwen2_moe":
            shapes[f"{prefix}.mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes
