"""The architecture of a Llama-family model, independent of where its weights come from.

Both loaders (Hugging Face directory, GGUF file) produce a `ModelArchConfig`;
the model code consumes nothing else. Field names follow Hugging Face's
`config.json` so a directory's config maps over one-to-one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Architectures whose math is the Llama block (RMSNorm, RoPE, GQA, SwiGLU).
# Qwen2 differs only by bias on q/k/v, which `attention_bias` covers.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"attention_bias": False},
    "MistralForCausalLM": {"attention_bias": False},
    "Qwen2ForCausalLM": {"attention_bias": True},
}


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but describes something servelm cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); `linear` also supported."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"{name} must be positive, found {getattr(self, name)}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArchConfig:
        """Build from a parsed Hugging Face `config.json`; raises UnsupportedModelError."""
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else None
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {architecture!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        defaults = SUPPORTED_ARCHITECTURES[architecture]
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(config)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", defaults["attention_bias"])),
            rope_scaling=_parse_rope_scaling(config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters`; older configs use `rope_scaling` + `rope_theta`.
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _rope_theta(config: dict[str, Any]) -> float:
    return config.get("rope_theta") or _rope_parameters(config).get("rope_theta") or 10000.0


def _parse_rope_scaling(config: dict[str, Any]) -> RopeScaling | None:
    params = _rope_parameters(config)
    rope_type = params.get("rope_type") or params.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(params["factor"]))
    raise UnsupportedModelError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3")
