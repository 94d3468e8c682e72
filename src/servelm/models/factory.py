"""Build a ready model from an architecture and its weights, in a chosen dtype on a chosen device."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from servelm.attention.backend import AttentionBackend, get_backend
from servelm.attention.selection import resolve_backend_name
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.models.arch import ModelArchConfig
from servelm.models.fused_decode import FusedDecodeLayers
from servelm.models.fused_ops import select_ops
from servelm.models.gemm_precision import check_gemm_precision
from servelm.models.linear_methods import LinearMethod, choose_linear_method, dense_method
from servelm.models.llama import LlamaForCausalLM
from servelm.models.rotary import RotaryEmbedding, inverse_frequencies
from servelm.models.weights import CheckpointWeights, Weight, select_model_weights
from servelm.parallel.groups import SINGLE_RANK, GroupMember

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
    weights: Mapping[str, Weight],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    # A registered name ("auto": by device, attention/selection.py), or an instance (context parallelism).
    attention_backend: str | AttentionBackend = "auto",
    block_linears: bool = True,
    tp: GroupMember = SINGLE_RANK,
    gemm_precision: str = "float32",
) -> LlamaForCausalLM:
    """The model with `weights` loaded, its parameters allocated once, in `dtype` on `device`.

    `weights`: a loader's `CheckpointWeights` (read tensor by tensor while loading) or any
    mapping of tensors by Hugging Face name; shapes are validated first (WeightShapeError).
    Each linear layer gets its `LinearMethod` from how its tensors are stored: GGUF Q4_1 / Q8_0
    layers (Q4_0 / Q4_1 / Q8_0) keep the file's blocks on CPU in float32 (`linear_methods`);
    `block_linears=False` makes every layer dense (the reference the block path is tested against).
    `gemm_precision`: what the decoder layers' many-row matmuls and the torch backend's prefill
    attention compute in (gemm_precision.py; not float32 on CPU float32 models only); the LM head
    stays float32: its logits pick the tokens.
    """
    device = torch.device(device)
    check_gemm_precision(gemm_precision, dtype, device)
    source = select_model_weights(CheckpointWeights.from_tensors(weights), arch)
    head_parts = {("lm_head",), ("model.embed_tokens",)}  # LlamaForCausalLM's head (tied or not)

    def linear_method(parts: Sequence[str], columns: range | None) -> LinearMethod:
        # The head stays float32 and unpacked: its many-row matmuls are rare (prompt logprobs,
        # verification of many drafts), and its panels would be ~1.2x a large matrix more, made
        # mid-serving after the residency passes were set up.
        head = tuple(parts) in head_parts
        precision = "float32" if head else gemm_precision
        if not block_linears:
            return dense_method(dtype, device, precision, pack_float32=not head)
        # What this rank's shard is stored as: blocks cut inside a block come out dense.
        infos = [source.info(f"{part}.weight").sharded(columns=columns) for part in parts]
        return choose_linear_method(infos, dtype, device, precision, pack_float32=not head)

    # Built on the meta device and given its dtype there, so the one allocation is `to_empty`'s:
    # no random init, no float32 copy first.
    with torch.device("meta"):
        backend: AttentionBackend
        if isinstance(attention_backend, str):
            name = resolve_backend_name(attention_backend, device)
            if arch.mla is not None and name == "triton":
                # The Triton kernels read a pool of K and V planes; latent attention's has one.
                if attention_backend != "auto":
                    raise ValueError("--attention-backend triton cannot run latent attention (DeepSeek-V2/V3) yet: use torch")
                name = "torch"
            if name == "torch" and gemm_precision == "bfloat16":  # prefill's attention GEMMs too
                backend = TorchAttentionBackend(prefill_compute_dtype=torch.bfloat16)
            else:
                backend = get_backend(name)
        else:
            backend = attention_backend
        model = LlamaForCausalLM(arch, backend, linear_method, tp)
    model.to(dtype)
    # `to_empty` less its `empty_like`, whose meta-tensor reference implementation imports sympy
    # (~1 s of every engine start-up); the meta parameters are contiguous, so `empty` is the same.
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if arch.tie_word_embeddings:  # to_empty breaks the tie; restore it before loading
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(source)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            # Frequencies stay float32 whatever the compute dtype, as in the reference.
            module.inv_freq = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling).to(device)
    model.norm_rotary_ops = select_ops(device)  # Triton kernels on CUDA, the compiled row ops on CPU
    model.fused_decode = FusedDecodeLayers.of(model)  # CPU GGUF-block models' small decode steps
    return model.eval()
