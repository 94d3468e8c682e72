"""One entry point for checkpoints: a Hugging Face directory, a GGUF file, or the embedded default model.

`load_checkpoint` dispatches on what the path is; `export_hf_directory` goes the other
way, writing any loaded checkpoint as a plain float32 Hugging Face directory (how the
default GGUF model is handed to other engines, e.g. vLLM, in benchmarks).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from servelm.default_model import default_model_path
from servelm.models.arch import ModelArchConfig, RopeScaling
from servelm.models.gguf_loader import load_gguf
from servelm.models.hf_loader import CONFIG_FILE, SINGLE_WEIGHTS_FILE, BeforeRead, load_hf_directory
from servelm.models.weights import CheckpointWeights

_EXPECTED = "a Hugging Face model directory with config.json or a .gguf file"
# HF `model_type` for each architecture we can run, for the config we export.
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
}  # fmt: skip


@dataclass
class LoadedCheckpoint:
    arch: ModelArchConfig
    weights: CheckpointWeights  # HF name -> tensor in the file dtype (or GGUF blocks), read on access; the model's tensors only
    tokenizer: Any  # a transformers PreTrainedTokenizerBase, chat template included when the checkpoint has one
    source: str  # the path it was loaded from, for messages and logs
    load_seconds: float = 0.0  # wall time of load_checkpoint, tokenizer included


def load_checkpoint(
    path: str | Path | None = None, hf_overrides: dict[str, Any] | None = None, before_read: BeforeRead | None = None
) -> LoadedCheckpoint:
    """Load weights, architecture and tokenizer; None means the embedded default model.

    A directory holding one .gguf file and no config.json loads that file (a pulled or
    peer-served GGUF model arrives as such a directory). `before_read(file, tensor)` is called
    before each safetensors tensor is read (a streaming load waits there for its bytes).

    `hf_overrides` (vLLM's --hf-overrides): Hugging Face config keys that replace the checkpoint's,
    e.g. {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "max_position_embeddings": 16384}
    to run past the trained context. Keys that change a tensor's shape fail when the weights load.

    Raises FileNotFoundError / ValueError saying what was expected, UnsupportedModelError
    for architectures or tensor types servelm cannot run, WeightShapeError for tensors
    that do not match the config.
    """
    started = time.perf_counter()
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if resolved.is_dir() and not (resolved / CONFIG_FILE).exists() and len(ggufs := list(resolved.glob("*.gguf"))) == 1:
        resolved = ggufs[0]
    if resolved.is_dir():
        arch, weights, tokenizer = load_hf_directory(resolved, before_read)
    elif resolved.is_file() and resolved.suffix.lower() == ".gguf":
        arch, weights, tokenizer = load_gguf(resolved)
    elif resolved.exists():
        raise ValueError(f"cannot load {resolved}: expected {_EXPECTED}, found a {resolved.suffix or 'extensionless'} file")
    else:
        raise FileNotFoundError(f"model path {resolved} does not exist; expected {_EXPECTED}")
    if hf_overrides:
        arch = ModelArchConfig.from_hf_config({**hf_config_dict(arch), **hf_overrides})
    return LoadedCheckpoint(arch, weights, tokenizer, str(resolved), time.perf_counter() - started)


def export_hf_directory(checkpoint: LoadedCheckpoint, out_dir: str | Path) -> Path:
    """Write config.json, generation_config.json, model.safetensors (float32) and the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config_dict(checkpoint.arch), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(checkpoint.arch), indent=2) + "\n")
    # safetensors refuses tensors that share memory; each read is a fresh tensor, never an alias.
    tensors = {name: checkpoint.weights.dense(name).to(torch.float32).contiguous() for name in checkpoint.weights}
    save_file(tensors, str(out / SINGLE_WEIGHTS_FILE), metadata={"format": "pt"})
    checkpoint.tokenizer.save_pretrained(str(out))
    return out


def hf_config_dict(arch: ModelArchConfig) -> dict[str, Any]:
    """A `config.json` that transformers (and vLLM) read as the same model; inverse of `from_hf_config`."""
    config: dict[str, Any] = {
        "architectures": [arch.architecture],
        "model_type": _MODEL_TYPES[arch.architecture],
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": _eos_value(arch),
        "torch_dtype": "float32",
    }
    if arch.moe is not None:
        config.update(arch.moe.hf_fields(arch.num_hidden_layers))
    if arch.mla is not None:
        config.update(arch.mla.hf_fields())
    if arch.rope_scaling is not None:
        config["rope_scaling"] = _rope_scaling_fields(arch.rope_scaling)
    return config


# The fields each scaling type's readers expect (another type's would confuse them).
_ROPE_SCALING_FIELDS = {
    "linear": ("rope_type", "factor"),
    "llama3": ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"),
}  # fmt: skip


def _rope_scaling_fields(scaling: RopeScaling) -> dict[str, Any]:
    values = dataclasses.asdict(scaling)
    return {name: values[name] for name in _ROPE_SCALING_FIELDS[scaling.rope_type] if values[name] is not None}


def _generation_config(arch: ModelArchConfig) -> dict[str, Any]:
    # vLLM and transformers take stop tokens from here, not from config.json.
    return {"bos_token_id": arch.bos_token_id, "eos_token_id": _eos_value(arch)}


def _eos_value(arch: ModelArchConfig) -> int | list[int] | None:
    if not arch.eos_token_ids:
        return None
    return arch.eos_token_ids[0] if len(arch.eos_token_ids) == 1 else list(arch.eos_token_ids)
