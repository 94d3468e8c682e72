"""The tensors a Llama-family model needs, by Hugging Face name and shape, and their validation.

Every loader ends here: whatever the file format, the model receives exactly the
names below with exactly these shapes, or the load fails naming the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from servelm.models.arch import ModelArchConfig

# How many problems one error message lists before summarising the rest.
_MAX_REPORTED = 5


class WeightShapeError(ValueError):
    """A checkpoint's tensors do not match its config: a tensor is missing or has the wrong shape."""


def expected_weight_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model consumes, keyed by Hugging Face parameter name."""
    hidden = arch.hidden_size
    q_size = arch.num_attention_heads * arch.head_dim
    kv_size = arch.num_key_value_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, hidden)}
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_size, hidden)
        if arch.attention_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (q_size,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv_size,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv_size,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, q_size)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (arch.intermediate_size, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (arch.intermediate_size, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, arch.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, hidden)
    return shapes


def validate_weights(weights: Mapping[str, torch.Tensor], arch: ModelArchConfig, source: str) -> None:
    """Raise WeightShapeError naming each missing or mis-shaped tensor; extra tensors are ignored.

    Extras are legitimate (`rotary_emb.inv_freq` buffers, an `lm_head` saved next to
    tied embeddings); the loaders drop them with `select_model_weights`.
    """
    problems: list[str] = []
    for name, shape in expected_weight_shapes(arch).items():
        tensor = weights.get(name)
        if tensor is None:
            problems.append(f"missing tensor {name!r} (expected shape {shape})")
        elif tuple(tensor.shape) != shape:
            problems.append(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    if problems:
        listed = "; ".join(problems[:_MAX_REPORTED])
        more = f"; and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise WeightShapeError(
            f"checkpoint {source} does not match its {arch.architecture} config "
            f"({arch.num_hidden_layers} layers, hidden {arch.hidden_size}): {listed}{more}"
        )


def select_model_weights(weights: dict[str, torch.Tensor], arch: ModelArchConfig, source: str) -> dict[str, torch.Tensor]:
    """Validate, then keep only the tensors the model consumes, as contiguous float32 on CPU."""
    validate_weights(weights, arch, source)
    return {name: _as_float32(weights[name]) for name in expected_weight_shapes(arch)}


def _as_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device="cpu", dtype=torch.float32).contiguous()
