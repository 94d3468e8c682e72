"""The Llama family (Llama 2/3, Mistral, SmolLM, Qwen2 with q/k/v bias) for a flattened batch.

Every forward takes the tokens of many requests end to end, `[num_tokens]`, with one
position per token; which token belongs to which request, and where its K/V live,
is the attention metadata's business. The model never sees a padded [batch, seq].

q/k/v and gate/up are each one fused matmul (one weight read instead of three or two);
`load_weights` concatenates the checkpoint's separate tensors into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.attention.backend import AttentionBackend, AttentionMetadata
from servelm.models.arch import ModelArchConfig
from servelm.models.compact_weights import MAX_ROWS as MAX_COMPACT_ROWS
from servelm.models.compact_weights import CompactWeight
from servelm.models.rotary import RotaryEmbedding, apply_rotary


class Linear(nn.Linear):
    """nn.Linear that may also hold its weight as verified int8 codes (`compact_weights`).

    A matmul of a few rows (a decode step of a few requests) is bound by reading the
    weight; with codes attached it reads those instead (under 1/3 of the bytes) and gets the
    same float32 weights. Larger inputs, or no codes, take the usual float32 path.
    """

    compact: CompactWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compact is not None and x.dim() == 2 and x.shape[0] <= MAX_COMPACT_ROWS and x.dtype == torch.float32:
            out = self.compact.matmul(x)
            if out is not None:
                return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype, as the reference does:
        #   weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)
        # torch's fused rms_norm is bitwise that in fp32 (one pass instead of five).
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, arch.rope_theta, arch.rope_scaling)
        self.backend = backend
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D/2] each (RotaryEmbedding.cos_sin)
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 KVH) * D]: q | k | v
        qk_size = self.q_size + self.kv_size
        # q and k sit side by side, so one rotation covers both heads' worth: [T, H + KVH, D].
        qk = apply_rotary(qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)

    def forward(self, rope, hidden, kv_cache, metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, backend) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long, position of each token within its request
        metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor] | None = None,  # one [2, blocks, block_size, KVH, D] per layer
    ) -> torch.Tensor:  # [T, hidden]
        hidden = self.embed_tokens(input_ids)
        # Every layer rotates by the same angles: computed once per forward, not once per layer.
        rope = self.layers[0].self_attn.rotary.cos_sin(positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(rope, hidden, None if kv_caches is None else kv_caches[i], metadata)
        return self.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] → logits [N, vocab] in float32 (sampling wants full precision)."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face-named state dict in, fusing q/k/v and gate/up. Shapes were validated by the loader."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
            self.norm.weight.copy_(weights["model.norm.weight"])
            if not self.arch.tie_word_embeddings:
                self.lm_head.weight.copy_(weights["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                prefix = f"model.layers.{i}."
                attn, mlp = layer.self_attn, layer.mlp
                qkv = [weights[f"{prefix}self_attn.{n}_proj.weight"] for n in "qkv"]
                attn.qkv_proj.weight.copy_(torch.cat(qkv, dim=0))
                if self.arch.attention_bias:
                    attn.qkv_proj.bias.copy_(torch.cat([weights[f"{prefix}self_attn.{n}_proj.bias"] for n in "qkv"]))
                attn.o_proj.weight.copy_(weights[f"{prefix}self_attn.o_proj.weight"])
                gate_up = [weights[f"{prefix}mlp.{n}_proj.weight"] for n in ("gate", "up")]
                mlp.gate_up_proj.weight.copy_(torch.cat(gate_up, dim=0))
                mlp.down_proj.weight.copy_(weights[f"{prefix}mlp.down_proj.weight"])
                layer.input_layernorm.weight.copy_(weights[f"{prefix}input_layernorm.weight"])
                layer.post_attention_layernorm.weight.copy_(weights[f"{prefix}post_attention_layernorm.weight"])
