"""Tiny random Llama-family checkpoints on disk (Llama, Qwen2, Qwen3, and the mixtures of experts
Mixtral, Qwen2-MoE and Qwen3-MoE), for tests and benchmarks that need many fast forwards.

    write_tiny_checkpoint(dir)          -> a Hugging Face directory transformers and servelm both load
    write_tiny_gguf(path, dir, ...)     -> the same weights as llama.cpp would write them (no tokenizer)
    write_first_layers_checkpoint(src, dir, n) -> src's first n layers with its embedding, norm and head
    write_random_checkpoint(dir, ...)   -> a random Llama of a real shape (SmolLM2-135M's by default) in
                                           bf16, written tensor by tensor (hundreds of MB in seconds)

The tokenizer is the default model's (SmolLM2, vocab 49152, ChatML template), so tiny
models tokenize and apply chat templates like a real one; the hidden size stays small,
so the 49152-row embedding is the bulk of the ~25 MB.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

from servelm.default_model import default_model_path
from servelm.models.arch import ModelArchConfig
from servelm.models.fp8_blocks import FP8_QUANTIZED_LINEAR, SCALE_SUFFIX, Fp8BlockScheme, quantize_fp8_blocks
from servelm.models.loader import hf_config_dict
from servelm.models.weights import expected_weight_shapes
from servelm.tokenization.loading import load_gguf_tokenizer

ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}  # fmt: skip
# The mixtures of experts' own sizes (small, several experts per token); overrides replace them.
_TINY_MOE: dict[str, dict[str, Any]] = {
    "mixtral": {"intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"moe_intermediate_size": 48, "shared_expert_intermediate_size": 80, "num_experts": 8,
                  "num_experts_per_tok": 3, "norm_topk_prob": False},
    "qwen3_moe": {"moe_intermediate_size": 48, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True},
    # Latent attention at a small scale (a latent of 32 + a RoPE key of 8 per token), a dense first
    # layer, 16 experts in 4 groups of which the best 2 are searched, and one shared expert.
    "deepseek_v3": {"num_hidden_layers": 3, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 48,
                    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                    "norm_topk_prob": True},
    # V2's router: softmax over 16 experts in 4 groups (a group scored by its best), the best 2
    # groups searched, no renormalisation, scaled; two shared experts; interleaved RoPE pairs.
    "deepseek_v2": {"num_hidden_layers": 3, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 48,
                    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                    "topk_method": "group_limited_greedy", "n_shared_experts": 2, "first_k_dense_replace": 1,
                    "routed_scaling_factor": 1.5},
}  # fmt: skip

# Small enough for a forward in milliseconds on CPU; GQA (4 heads over 2 KV heads) on purpose.
_TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
# SmolLM2-135M's shape (the default model's), for checkpoints of a realistic size.
SMOLLM2_135M_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
# llama.cpp leaf name for each HF parameter inside a layer.
_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_checkpoint(
    directory: str | Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    init_std: float = 0.1,
    max_shard_size: str | None = None,
    tokenizer: Any = None,
    **overrides: Any,
) -> Path:
    """Save a random float32 model + a tokenizer (None: the default model's) with `save_pretrained`;
    returns the directory.

    `overrides` go into the transformers config (e.g. num_hidden_layers=4, tie_word_embeddings=True).
    Every parameter, biases and norm weights included, is drawn from the seed so that a loader
    that drops or swaps a tensor changes the output. `init_std` 0.1 (not transformers' 0.02)
    spreads the logits, so greedy parity tests do not hinge on near-ties.
    `max_shard_size` (e.g. "2MB") writes shards and a model.safetensors.index.json.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    out = Path(directory)
    tokenizer = tokenizer if tokenizer is not None else load_gguf_tokenizer(default_model_path())
    config_class = getattr(transformers, ARCHITECTURES[arch].replace("ForCausalLM", "Config"))
    values = {
        **_TINY_CONFIG,
        **_TINY_MOE.get(arch, {}),
        "vocab_size": len(tokenizer),
        # Llama keeps a separate lm_head and Qwen2 ties it, so the two cover both layouts.
        "tie_word_embeddings": arch == "qwen2",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        **overrides,
    }
    if values["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {values['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} tokens")
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[arch])(config_class(**values)).to(torch.float32)
    _randomize(model, init_std)
    shard_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **shard_kwargs)
    tokenizer.save_pretrained(str(out))
    return out


def write_random_checkpoint(
    directory: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    *,
    max_shard_bytes: int | None = None,
    fp8_block: tuple[int, int] | None = None,
    **overrides: Any,
) -> Path:
    """Save a random Llama (SmolLM2-135M's shape, `overrides` on top) as one safetensors file in `dtype`,
    with config.json and the default tokenizer; returns the directory. `fp8_block`: the decoder layers'
    linear weights in FP8 with a scale per block, as DeepSeek-V3 ships them (write_fp8_checkpoint).

    Tensors are drawn one by one (std 0.02, norms 1) without building a transformers model, so a
    checkpoint of hundreds of MB takes seconds. For load-time, memory and delivery measurements, not
    parity. `max_shard_bytes` cuts the tensors (in order) into shards of at most that much (a larger
    tensor alone), model-0000i-of-0000n.safetensors plus a model.safetensors.index.json, as
    `save_pretrained` does.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_gguf_tokenizer(default_model_path())
    arch = ModelArchConfig.from_hf_config({**SMOLLM2_135M_CONFIG, "bos_token_id": tokenizer.bos_token_id,
                                           "eos_token_id": tokenizer.eos_token_id, **overrides})  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_weight_shapes(arch).items():
        if len(shape) == 1:  # norm weights
            tensors[name] = torch.ones(shape, dtype=dtype)
        elif fp8_block is not None and FP8_QUANTIZED_LINEAR.match(name):
            quantized = quantize_fp8_blocks(torch.randn(shape, generator=generator) * 0.02, Fp8BlockScheme(*fp8_block))
            tensors[name], tensors[name + SCALE_SUFFIX] = quantized.codes, quantized.scales
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
    if max_shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        _save_shards(tensors, out, max_shard_bytes)
    config = {**hf_config_dict(arch), "torch_dtype": str(dtype).removeprefix("torch.")}
    if fp8_block is not None:
        config["quantization_config"] = _fp8_quantization_config(fp8_block)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
    return out


def _fp8_quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def _save_shards(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        shard_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / shard_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, shard_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_fp8_checkpoint(source: str | Path, directory: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """A copy of a Hugging Face checkpoint with its decoder layers' linear weights in FP8 e4m3 and a
    float32 scale per `block` (`X.weight_scale_inv`), config.json saying so: the layout DeepSeek-V3
    ships. Shards and their index are kept as they are (each scale beside its weight)."""
    src, out = Path(source), Path(directory)
    shutil.copytree(src, out)
    scheme = Fp8BlockScheme(*block)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    for file in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name in [n for n in tensors if FP8_QUANTIZED_LINEAR.match(n)]:
            quantized = quantize_fp8_blocks(tensors[name], scheme)
            tensors[name], tensors[name + SCALE_SUFFIX] = quantized.codes, quantized.scales
            if index is not None:
                index["weight_map"][name + SCALE_SUFFIX] = file.name
        save_file(tensors, str(file), metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _fp8_quantization_config(block)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def write_first_layers_checkpoint(source: str | Path, directory: str | Path, num_layers: int) -> Path:
    """A Hugging Face checkpoint (one safetensors file) cut to its first `num_layers` decoder layers,
    embedding, final norm and head kept, tokenizer copied: a draft model that often agrees with its
    source (the same as a self-speculative draft of `num_layers`, as a checkpoint of its own)."""
    src, out = Path(source), Path(directory)
    shutil.copytree(src, out)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{config['num_hidden_layers']}, got {num_layers}")
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2) + "\n")
    kept = {
        name: tensor
        for name, tensor in load_file(str(src / "model.safetensors")).items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@torch.no_grad()
def _randomize(model: torch.nn.Module, init_std: float) -> None:
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + init_std * torch.randn_like(param))  # near 1, but a skipped norm shows
        else:
            param.normal_(0.0, init_std)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zero would hide a dropped one
            buffer.normal_(0.0, init_std)


def write_tiny_gguf(
    path: str | Path,
    hf_directory: str | Path,
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    override_types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write a single-file tiny HF checkpoint as llama.cpp's converter would: names, reversed shapes,
    q/k rows permuted for `llama`, 2-D weights stored as `tensor_type` (norms and biases stay F32).

    `override_types` forces a type per GGUF tensor name; types gguf cannot quantise are written
    as zero bytes, which is enough to exercise a loader's type check. No tokenizer metadata.
    """
    directory = Path(hf_directory)
    config = json.loads((directory / "config.json").read_text())
    arch = {v: k for k, v in ARCHITECTURES.items()}[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    _write_metadata(writer, arch, config)
    for name, tensor in load_file(str(directory / "model.safetensors")).items():
        gguf_name = _hf_to_gguf_name(name)
        values = tensor.to(torch.float32).numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            values = llama_cpp_permute(values, heads)
        qtype = (override_types or {}).get(
            gguf_name, tensor_type if values.ndim == 2 else gguf.GGMLQuantizationType.F32
        )
        _add_tensor(writer, gguf_name, values, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def llama_cpp_permute(values: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), verbatim in numpy."""
    return (
        values.reshape(num_heads, 2, values.shape[0] // num_heads // 2, *values.shape[1:])
        .swapaxes(1, 2)
        .reshape(values.shape)
    )


def _write_metadata(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(config["bos_token_id"])
    if config.get("eos_token_id") is not None:
        writer.add_eos_token_id(config["eos_token_id"])


def _rope_theta(config: dict[str, Any]) -> float:
    # transformers 5 writes it under rope_parameters.
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def _add_tensor(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        return
    try:
        data = gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        data = np.zeros((*values.shape[:-1], values.shape[-1] // block_size * type_size), dtype=np.uint8)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def _hf_to_gguf_name(name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip
    if name in globals_:
        return globals_[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.{i}.{module}.{weight|bias}
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{kind}"
