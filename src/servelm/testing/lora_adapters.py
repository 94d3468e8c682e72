"""LoRA adapters written by hand in PEFT's format (no peft needed), and the merged-weight reference
they are checked against: transformers' model with W + scaling * B @ A in every targeted module."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from servelm.models.arch import ModelArchConfig
from servelm.models.weights import expected_weight_shapes

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(directory: str | Path, arch: ModelArchConfig, rank: int, *, alpha: float | None = None,
                       targets: Sequence[str] = ALL_TARGETS, seed: int = 0, std: float = 0.05,
                       use_rslora: bool = False, **config: object) -> Path:  # fmt: skip
    """A random adapter of `rank` on `targets` in every decoder layer of a base model of `arch`, as
    PEFT saves one (adapter_config.json, adapter_model.safetensors). B is non-zero (a trained
    adapter's is), so the adapter changes the output. `config` adds or overrides config keys."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (out_features, in_features) in _target_shapes(arch, targets).items():
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": use_rslora,
        "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
        **config,
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def _target_shapes(arch: ModelArchConfig, targets: Sequence[str]) -> dict[str, tuple[int, ...]]:
    return {name.removesuffix(".weight"): shape for name, shape in expected_weight_shapes(arch).items()
            if name.endswith("_proj.weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in targets}  # fmt: skip


@torch.no_grad()
def merge_into(model: torch.nn.Module, adapter_dir: str | Path) -> torch.nn.Module:
    """`model` (transformers', float32) with the adapter merged into its weights, in place:
    W += scaling * B @ A, scaling = lora_alpha / r (/ sqrt(r) with use_rslora)."""
    from safetensors.torch import load_file

    directory = Path(adapter_dir)
    config = json.loads((directory / "adapter_config.json").read_text())
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    parameters = dict(model.named_parameters())
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = tensors[key.replace("lora_A", "lora_B")]
        parameters[f"{module}.weight"].add_(scaling * (b.double() @ a.double()).float())
    return model
