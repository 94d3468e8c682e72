"""The architecture of a Llama-family model, independent of where its weights come from.

Both loaders (Hugging Face directory, GGUF file) produce a `ModelArchConfig`;
the model code consumes nothing else. Field names follow Hugging Face's
`config.json` so a directory's config maps over one-to-one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Architectures whose math is the Llama block (RMSNorm, RoPE, GQA, SwiGLU). Qwen2 differs only by
# bias on q/k/v (`attention_bias`), Qwen3 by an RMSNorm over each q and k head before RoPE
# (`qk_norm`); the mixtures of experts replace the MLP of some or all layers with routed experts
# (`moe`: MoEConfig, whose `naming` says where the family keeps their tensors).
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"attention_bias": False},
    "MistralForCausalLM": {"attention_bias": False},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"attention_bias": False, "qk_norm": True},
    "MixtralForCausalLM": {"attention_bias": False, "moe": "mixtral"},
    "Qwen2MoeForCausalLM": {"attention_bias": True, "moe": "qwen2_moe"},
    "Qwen3MoeForCausalLM": {"attention_bias": False, "qk_norm": True, "moe": "qwen3_moe"},
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
class MoEConfig:
    """The routed experts of a mixture-of-experts model (models/moe.py runs them).

    Each token's router scores every expert (softmax), keeps the `top_k` best, optionally
    renormalises their weights to sum to 1 (`norm_topk_prob`), and sums those experts' SwiGLU
    outputs by weight. Qwen2-MoE adds a shared expert every token passes through, scaled by a
    sigmoid gate of its own. Layers outside `sparse_layers` keep a dense MLP."""

    naming: str  # "mixtral" | "qwen2_moe" | "qwen3_moe": where the checkpoint keeps the tensors
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.expert_intermediate_size <= 0:
            raise UnsupportedModelError(f"the experts' intermediate size must be positive, found {self.expert_intermediate_size}")

    @classmethod
    def from_hf_config(cls, naming: str, config: dict[str, Any], num_layers: int) -> MoEConfig:
        if naming == "mixtral":
            return cls(naming, int(config["num_local_experts"]), int(config["num_experts_per_tok"]),
                       int(config["intermediate_size"]), True, frozenset(range(num_layers)))  # fmt: skip
        # Published Qwen configs say num_experts; transformers 5 writes num_local_experts.
        num_experts = int(config.get("num_experts") or config["num_local_experts"])
        step = int(config.get("decoder_sparse_step") or 1)
        dense_only = set(config.get("mlp_only_layers") or [])
        sparse = frozenset(i for i in range(num_layers) if i not in dense_only and num_experts > 0 and (i + 1) % step == 0)
        shared = int(config.get("shared_expert_intermediate_size") or 0) if naming == "qwen2_moe" else 0
        return cls(naming, num_experts, int(config["num_experts_per_tok"]), int(config["moe_intermediate_size"]),
                   bool(config.get("norm_topk_prob", False)), sparse, shared)  # fmt: skip

    def hf_fields(self, num_layers: int) -> dict[str, Any]:
        """The config.json fields that say the same (inverse of from_hf_config)."""
        if self.naming == "mixtral":
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.top_k}
        fields: dict[str, Any] = {
            "num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.expert_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(num_layers) if i not in self.sparse_layers],
        }  # fmt: skip
        if self.naming == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return fields


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
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3)
    moe: MoEConfig | None = None  # routed experts in place of some or all layers' MLP

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
        num_layers = int(config["num_hidden_layers"])
        moe_naming = defaults.get("moe")
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(config)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2-MoE names it qkv_bias.
            attention_bias=bool(config.get("attention_bias", config.get("qkv_bias", defaults["attention_bias"]))),
            rope_scaling=_parse_rope_scaling(config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=bool(defaults.get("qk_norm", False)),
            moe=MoEConfig.from_hf_config(moe_naming, config, num_layers) if moe_naming else None,
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
