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
# (`moe`: MoEConfig, whose `naming` says where the family keeps their tensors); DeepSeek-V3 also
# replaces attention with multi-head latent attention (`mla`: MLAConfig).
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"attention_bias": False},
    "MistralForCausalLM": {"attention_bias": False},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"attention_bias": False, "qk_norm": True},
    "MixtralForCausalLM": {"attention_bias": False, "moe": "mixtral"},
    "Qwen2MoeForCausalLM": {"attention_bias": True, "moe": "qwen2_moe"},
    "Qwen3MoeForCausalLM": {"attention_bias": False, "qk_norm": True, "moe": "qwen3_moe"},
    # Multi-head latent attention (`mla`: models/mla.py) and sigmoid-scored experts chosen within
    # the best groups, after dense first layers (models/moe.py).
    "DeepseekV2ForCausalLM": {"attention_bias": False, "moe": "deepseek_v2", "mla": True},
    "DeepseekV3ForCausalLM": {"attention_bias": False, "moe": "deepseek_v3", "mla": True},
}


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but describes something servelm cannot run."""


class UnsupportedQuantizationError(UnsupportedModelError):
    """The checkpoint's weights are stored in a form servelm does not read (a GGUF tensor type, a
    quantization scheme in config.json): said before any tensor is loaded as if it were plain values."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); `linear`, and YaRN (`yarn`: DeepSeek-V3,
    Qwen's long-context configs; models/rotary.py) also supported."""

    rope_type: str  # "llama3" | "linear" | "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN: the rotation counts bounding the ramp between extrapolated and interpolated frequencies,
    # the magnitude scales (mscale, mscale_all_dim) or an explicit attention factor, and whether the
    # ramp's bounds are rounded out (truncate).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


# The DeepSeek families' MoE namings: the same tensor names, group-limited routers (MoEConfig).
DEEPSEEK_NAMINGS = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of a mixture-of-experts model (models/moe.py runs them).

    Each token's router scores every expert (softmax), keeps the `top_k` best, optionally
    renormalises their weights to sum to 1 (`norm_topk_prob`), and sums those experts' SwiGLU
    outputs by weight. Qwen2-MoE adds a shared expert every token passes through, scaled by a
    sigmoid gate of its own. Layers outside `sparse_layers` keep a dense MLP."""

    naming: str  # "mixtral" | "qwen2_moe" | "qwen3_moe" | "deepseek_v2" | "deepseek_v3": where the checkpoint keeps the tensors
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # DeepSeek's routers (models/moe.py route_grouped) keep the `topk_group` best of `num_groups`
    # groups of experts, and weigh the chosen ones by their scores times `routed_scaling_factor`.
    # V3 scores each expert by a sigmoid, adds a per-expert bias (`e_score_correction_bias`) to choose
    # and scores a group by its two best experts; V2 scores by softmax and a group by its best expert
    # (`topk_method` "group_limited_greedy"; "greedy" is one group). Their shared experts have no gate.
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    num_groups: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.num_experts % self.num_groups or not 0 < self.topk_group <= self.num_groups:
            raise UnsupportedModelError(f"n_group ({self.num_groups}) must divide the experts ({self.num_experts}) "
                                        f"and topk_group ({self.topk_group}) be in 1..n_group")  # fmt: skip
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.expert_intermediate_size <= 0:
            raise UnsupportedModelError(f"the experts' intermediate size must be positive, found {self.expert_intermediate_size}")

    @classmethod
    def from_hf_config(cls, naming: str, config: dict[str, Any], num_layers: int) -> MoEConfig:
        if naming == "mixtral":
            return cls(naming, int(config["num_local_experts"]), int(config["num_experts_per_tok"]),
                       int(config["intermediate_size"]), True, frozenset(range(num_layers)))  # fmt: skip
        if naming in DEEPSEEK_NAMINGS:
            num_experts = int(config.get("n_routed_experts") or config["num_local_experts"])
            first_sparse, every = int(config.get("first_k_dense_replace") or 0), int(config.get("moe_layer_freq") or 1)
            width = int(config["moe_intermediate_size"])
            v3 = naming == "deepseek_v3"
            grouped = v3 or config.get("topk_method") == "group_limited_greedy"  # V2's "greedy": one group
            return cls(naming, num_experts, int(config["num_experts_per_tok"]), width,
                       bool(config.get("norm_topk_prob", v3)),
                       frozenset(i for i in range(first_sparse, num_layers) if i % every == 0),
                       width * int(config.get("n_shared_experts") or 0), scoring="sigmoid" if v3 else "softmax",
                       num_groups=int(config.get("n_group") or 1) if grouped else 1,
                       topk_group=int(config.get("topk_group") or 1) if grouped else 1,
                       routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))  # fmt: skip
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
        if self.naming in DEEPSEEK_NAMINGS:
            first_sparse = min(self.sparse_layers, default=num_layers)
            deepseek: dict[str, Any] = {
                "n_routed_experts": self.num_experts, "num_experts_per_tok": self.top_k,
                "moe_intermediate_size": self.expert_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "first_k_dense_replace": first_sparse, "moe_layer_freq": 1,
                "n_shared_experts": self.shared_expert_intermediate_size // self.expert_intermediate_size,
                "n_group": self.num_groups, "topk_group": self.topk_group,
                "routed_scaling_factor": self.routed_scaling_factor,
            }  # fmt: skip
            if self.naming == "deepseek_v2":
                deepseek["topk_method"] = "group_limited_greedy" if self.num_groups > 1 else "greedy"
            return deepseek
        fields: dict[str, Any] = {
            "num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.expert_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(num_layers) if i not in self.sparse_layers],
        }  # fmt: skip
        if self.naming == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return fields


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3; models/mla.py runs it).

    Per token, K and V of every head come from one compressed latent of `kv_lora_rank` values (by
    kv_b_proj) and a single RoPE key of `qk_rope_head_dim` shared by all heads: the KV pool stores
    those `latent_dim` values per token and layer and nothing else (576 at V3's sizes, against
    2 x 128 heads x 128 for full K and V). A query head is `qk_nope_head_dim` + `qk_rope_head_dim`
    wide, a value head `v_head_dim`; q comes through a low-rank `q_lora_rank` projection when set."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's RoPE dimensions are interleaved pairs (V3's default)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values stored per token and layer: the latent, then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> MLAConfig:
        q_lora_rank = config.get("q_lora_rank")
        return cls(None if q_lora_rank is None else int(q_lora_rank), int(config["kv_lora_rank"]),
                   int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"]), int(config["v_head_dim"]),
                   bool(config.get("rope_interleave", True)))  # fmt: skip

    def hf_fields(self) -> dict[str, Any]:
        return {"q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim, "rope_interleave": self.rope_interleave}  # fmt: skip


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
    mla: MLAConfig | None = None  # latent attention in place of q/k/v heads (head_dim: its RoPE part)

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

    # What the paged KV pool stores per token and layer: planes x heads x head_dim. K and V of each
    # KV head (2 planes); under latent attention one plane of one head, the latent and the RoPE key,
    # which is both what the keys are read from and what the values are (models/mla.py).

    @property
    def kv_planes(self) -> int:
        return 1 if self.mla is not None else 2

    @property
    def kv_cache_heads(self) -> int:
        return 1 if self.mla is not None else self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        return self.mla.latent_dim if self.mla is not None else self.head_dim

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
        mla = MLAConfig.from_hf_config(config) if defaults.get("mla") else None
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=mla.qk_rope_head_dim if mla else int(config.get("head_dim") or hidden // num_heads),
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
            mla=mla,
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
    if rope_type == "yarn":
        original = params.get("original_max_position_embeddings") or config.get("max_position_embeddings", 2048)
        factor = params.get("factor") or float(config["max_position_embeddings"]) / float(original)

        def optional(name: str) -> float | None:
            return None if params.get(name) is None else float(params[name])

        return RopeScaling(rope_type="yarn", factor=float(factor), original_max_position_embeddings=int(original),
                           beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                           mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"),
                           attention_factor=optional("attention_factor"), truncate=bool(params.get("truncate", True)))  # fmt: skip
    raise UnsupportedModelError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3, yarn")
