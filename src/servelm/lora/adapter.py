"""A PEFT LoRA adapter read from its directory, checked against the base model before it is served.

    ADAPTER_DIR/adapter_config.json          r, lora_alpha, use_rslora, target_modules, ...
    ADAPTER_DIR/adapter_model.safetensors    base_model.model.<module>.lora_A.weight  [r, in]
                                             base_model.model.<module>.lora_B.weight  [out, r]

A target module's output gains scaling * (x @ A^T) @ B^T, scaling = lora_alpha / r (lora_alpha /
sqrt(r) with use_rslora): the same as serving the merged weight W + scaling * B @ A. What servelm
does not serve is refused by name, never dropped: DoRA, modules_to_save, trained biases,
fan_in_fan_out (GPT-2's Conv1D), per-module ranks or alphas (rank_pattern, alpha_pattern), and
modules other than the decoder layers' attention and MLP projections (embeddings, the LM head).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from servelm.models.arch import ModelArchConfig
from servelm.models.weights import expected_weight_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: the decoder layers' attention and MLP (dense models).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served on this base model; the message says why."""


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights by base-model module ("model.layers.3.self_attn.q_proj"), float32."""

    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) (rsLoRA)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_lora_adapter(name: str, path: str | Path, arch: ModelArchConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and check the adapter at `path` for a base model of `arch`; LoRAAdapterError naming what
    does not fit (a missing file, an unsupported option, a rank over `max_lora_rank`, a tensor whose
    shape does not match the base)."""
    directory = Path(path)
    config = _read_config(directory)
    rank = int(config.get("r") or 0)
    if rank <= 0:
        raise LoRAAdapterError(f"adapter {name!r}: r must be a positive integer, got {config.get('r')!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"adapter {name!r} has rank {rank}, over --max-lora-rank {max_lora_rank}")
    alpha = float(config.get("lora_alpha") or rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if arch.moe is not None or arch.mla is not None:
        raise LoRAAdapterError(f"adapter {name!r}: LoRA is served on dense attention models only, not {arch.architecture}")
    shapes = expected_weight_shapes(arch)
    pairs = _read_pairs(name, directory / WEIGHTS_FILE)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a, b) in sorted(pairs.items()):
        leaf = module.rsplit(".", 1)[-1]
        base = shapes.get(f"{module}.weight")
        if leaf not in TARGET_MODULES or base is None:
            raise LoRAAdapterError(
                f"adapter {name!r} targets {module!r}: servelm serves LoRA on the decoder layers' "
                f"{', '.join(TARGET_MODULES)} only"
            )
        out_features, in_features = base
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base "
                f"model's {tuple(base)} weight at rank {rank} needs ({rank}, {in_features}) and ({out_features}, {rank})"
            )
        weights[module] = (a.float().contiguous(), b.float().contiguous())
    if not weights:
        raise LoRAAdapterError(f"adapter {name!r}: {directory / WEIGHTS_FILE} holds no lora_A / lora_B tensors")
    return LoRAAdapter(name, str(directory), rank, scaling, weights)


def _read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAAdapterError(f"{directory} is not a PEFT LoRA adapter: no {CONFIG_FILE} in it")
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise LoRAAdapterError(f"{config_path} is not valid JSON: {exc}") from exc
    refusals = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (LORA only)"),
        "use_dora": (bool(config.get("use_dora")), "DoRA (use_dora)"),
        "modules_to_save": (bool(config.get("modules_to_save")), f"modules_to_save {config.get('modules_to_save')}"),
        "bias": (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')!r})"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D weights)"),
        "rank_pattern": (bool(config.get("rank_pattern")), "per-module ranks (rank_pattern)"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "per-module alphas (alpha_pattern)"),
    }
    for refused, what in refusals.values():
        if refused:
            raise LoRAAdapterError(f"{directory}: servelm does not serve LoRA adapters with {what}")
    return config


def _read_pairs(name: str, file: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    if not file.is_file():
        raise LoRAAdapterError(f"adapter {name!r}: no {WEIGHTS_FILE} in {file.parent}")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for key in f.keys():
            match = _TENSOR.match(key)
            if match is None:
                raise LoRAAdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight servelm serves")
            halves.setdefault(match["module"], {})[match["which"]] = f.get_tensor(key)
    incomplete = [module for module, parts in halves.items() if set(parts) != {"A", "B"}]
    if incomplete:
        raise LoRAAdapterError(f"adapter {name!r}: {incomplete[0]} has lora_A without lora_B or the reverse")
    return {module: (parts["A"], parts["B"]) for module, parts in halves.items()}
