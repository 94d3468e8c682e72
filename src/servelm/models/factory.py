"""Build a ready model from an architecture and a state dict, in a chosen dtype on a chosen device."""

from __future__ import annotations

import torch

import servelm.attention.torch_backend  # noqa: F401  (registers "torch")
from servelm.attention.backend import get_backend
from servelm.models.arch import ModelArchConfig
from servelm.models.compact_weights import find_codes
from servelm.models.llama import Linear, LlamaForCausalLM
from servelm.models.rotary import RotaryEmbedding, inverse_frequencies

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """'auto' → cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' → float32 on CPU (exact, and CPU bf16 matmuls are slower), bfloat16 on accelerators."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def build_model(
    arch: ModelArchConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_backend: str = "torch",
    compact_weights: bool = True,
) -> LlamaForCausalLM:
    """The model with `weights` loaded. On CPU in float32, linear weights that are exactly
    block-quantised values (the default GGUF model's) also get int8 codes for small-batch
    matmuls (`servelm.models.compact_weights`); `compact_weights=False` skips that."""
    device = torch.device(device)
    # Built on the meta device so no memory or time goes to a random init that is overwritten.
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, get_backend(attention_backend))
    model.to_empty(device=device)
    model.to(dtype)
    if arch.tie_word_embeddings:  # to_empty breaks the tie; restore it before loading
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(weights)
    if compact_weights and device.type == "cpu" and dtype == torch.float32:
        attach_compact_weights(model)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            # Frequencies stay float32 whatever the compute dtype, as in the reference.
            module.inv_freq = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling).to(device)
    return model.eval()


def attach_compact_weights(model: LlamaForCausalLM) -> int:
    """Give every linear layer whose float32 weight is exactly block-quantised its int8 codes.

    Returns how many layers got them. Checks one layer first: a model whose first
    projection is ordinary float32 (any non-quantised checkpoint) costs one cheap look.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or find_codes(linears[0].weight) is None:
        return 0
    count = 0
    for module in linears:
        module.compact = find_codes(module.weight)
        count += module.compact is not None
    return count
