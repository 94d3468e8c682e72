"""Multi-head latent attention (DeepSeek-V2 and V3): `LatentAttention`, in the weight-absorbed form.

Per token the checkpoint's attention computes, for H heads,

    c = norm(x W_kva[:r])          the latent, r = kv_lora_rank values
    k_rope = rope(x W_kva[r:])     one RoPE key of d_r values, shared by every head
    k_h = [c W_uk_h ; k_rope]      v_h = c W_uv_h         (W_uk_h, W_uv_h: head h's rows of kv_b_proj)
    q_h = [q_nope_h ; rope(q_rope_h)]

so a score is q_h . k_h = (q_nope_h W_uk_h^T) . c + rope(q_rope_h) . k_rope. Absorbing W_uk into the
query makes every head attend over the same (r + d_r)-wide key per token, [c ; k_rope]: attention
with one KV head whose value is that same vector; the output's first r values are sum_t p_t c_t, and
W_uv_h turns them into the head's value. So the KV pool stores `latent_dim` = r + d_r values per
token and layer (one plane, one head: ModelArchConfig.kv_planes / kv_cache_heads) and any attention
backend that reads a pool by slots runs it unchanged, with the value read where the key is
(kv_storage.py). Prefill takes the same form: the pool is what it reads either way.

RoPE: the checkpoint's RoPE dimensions are interleaved pairs (rope_interleave, V3's default): they
are put in half-split order before rotating, the same permutation for q and k, which leaves every
dot product as the checkpoint's.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.attention.backend import AttentionBackend, AttentionMetadata
from servelm.attention.kv_storage import LayerKVCache
from servelm.models.arch import ModelArchConfig
from servelm.models.fused_ops import Rotate
from servelm.models.layers import Linear, RMSNorm
from servelm.models.linear_methods import LinearMethodChooser
from servelm.models.rotary import RotaryEmbedding, yarn_mscale
from servelm.models.sharding import ModelShard, whole
from servelm.models.weights import CheckpointWeights, dense_tensor


def half_split_order(dim: int) -> torch.Tensor:
    """Indices that put interleaved RoPE pairs (x0, x1), (x2, x3), ... as halves (x0, x2, ... | x1, x3, ...)."""
    return torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))


class LatentAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, prefix: str,
                 linear_method: LinearMethodChooser, shard: ModelShard) -> None:  # fmt: skip
        super().__init__()
        mla = arch.mla
        assert mla is not None
        self.mla = mla
        self.prefix = prefix
        # Tensor parallelism splits the heads (q's rows, kv_b's heads, o_proj's columns, all-reduced);
        # the latent and the RoPE key are every head's, so each rank computes and caches them whole.
        self.heads = shard.attention.q_heads
        self.num_heads = len(self.heads)
        hidden, heads, all_heads = arch.hidden_size, self.num_heads, arch.num_attention_heads

        def head_rows(per_head: int) -> range | None:
            return whole(range(self.heads.start * per_head, self.heads.stop * per_head), all_heads * per_head)

        def linear(name: str, in_features: int, out_features: int, bias: bool = False, rows: range | None = None,
                   columns: range | None = None) -> Linear:  # fmt: skip
            parts = (f"{prefix}.{name}",)
            return Linear(in_features, out_features, bias, parts, linear_method(parts, columns), rows=(rows,),
                          columns=columns, reduce=shard.tp if columns is not None else None)  # fmt: skip

        q_width, q_rows = heads * mla.qk_head_dim, head_rows(mla.qk_head_dim)
        self.q_a_proj: Linear | None = None  # q through a low-rank projection (q_lora_rank), or q_proj alone
        self.q_a_layernorm: RMSNorm | None = None
        if mla.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, q_width, rows=q_rows)
        else:
            self.q_a_proj = linear("q_a_proj", hidden, mla.q_lora_rank, arch.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, arch.rms_norm_eps)
            self.q_proj = linear("q_b_proj", mla.q_lora_rank, q_width, rows=q_rows)
        self.kv_a_proj = linear("kv_a_proj_with_mqa", hidden, mla.latent_dim, arch.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, arch.rms_norm_eps)
        # kv_b_proj's rows per head: W_uk (qk_nope_head_dim rows) then W_uv (v_head_dim rows).
        self.w_uk = nn.Parameter(torch.empty(heads, mla.qk_nope_head_dim, mla.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(heads, mla.v_head_dim, mla.kv_lora_rank))
        self.o_proj = linear("o_proj", heads * mla.v_head_dim, hidden, arch.attention_bias,
                             columns=head_rows(mla.v_head_dim))  # fmt: skip
        self.rotary = RotaryEmbedding(mla.qk_rope_head_dim, arch.rope_theta, arch.rope_scaling)
        self._rope_order: torch.Tensor | None = None  # made on first use, on the model's device
        self.backend = backend
        # YaRN's magnitude correction over every dimension goes into the softmax scale, squared (the
        # reference's yarn_apply_mscale: it scales q and k both).
        scaling = arch.rope_scaling
        all_dims = yarn_mscale(scaling.factor, scaling.mscale_all_dim) if scaling is not None and scaling.mscale_all_dim else 1.0
        self.scale = mla.qk_head_dim**-0.5 * all_dims * all_dims

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, d_r / 2] each
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: LayerKVCache | None,  # one plane [1, blocks, block_size, 1, latent_dim]
        metadata: AttentionMetadata,
        rotate: Rotate,
    ) -> torch.Tensor:
        mla, heads, num_tokens = self.mla, self.num_heads, hidden.shape[0]
        q_in = hidden if self.q_a_proj is None or self.q_a_layernorm is None else self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_proj(q_in).view(num_tokens, heads, mla.qk_head_dim)
        q_nope, q_rope = q.split((mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1)
        latent, k_rope = self.kv_a_proj(hidden).split((mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # q's and the key's RoPE parts side by side, so one rotation covers both: [T, H + 1, d_r].
        rope_parts = torch.cat((q_rope, k_rope.unsqueeze(1)), dim=1)
        if mla.rope_interleave:
            if self._rope_order is None or self._rope_order.device != hidden.device:
                self._rope_order = half_split_order(mla.qk_rope_head_dim).to(hidden.device)
            rope_parts = rope_parts.index_select(-1, self._rope_order)
        rope_parts = rotate(rope_parts.contiguous(), *rope)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)  # W_uk absorbed: [T, H, r]
        query = torch.cat((q_latent, rope_parts[:, :heads]), dim=-1)  # [T, H, r + d_r]
        key = torch.cat((latent, rope_parts[:, heads]), dim=-1).unsqueeze(1)  # [T, 1, r + d_r]: what the pool stores
        out = self.backend.forward(query, key, key, kv_cache, metadata, self.scale)  # [T, H, r + d_r]
        values = torch.einsum("thc,hvc->thv", out[..., : mla.kv_lora_rank], self.w_uv)  # [T, H, v]
        return self.o_proj(values.reshape(num_tokens, heads * mla.v_head_dim))

    def load(self, weights: CheckpointWeights) -> None:
        mla = self.mla
        for layer in (self.q_a_proj, self.q_proj, self.kv_a_proj, self.o_proj):
            if layer is not None:
                layer.load(weights)
        if self.q_a_layernorm is not None:
            self.q_a_layernorm.weight.copy_(dense_tensor(weights[f"{self.prefix}.q_a_layernorm.weight"]))
        self.kv_a_layernorm.weight.copy_(dense_tensor(weights[f"{self.prefix}.kv_a_layernorm.weight"]))
        per_head = mla.qk_nope_head_dim + mla.v_head_dim
        rows = range(self.heads.start * per_head, self.heads.stop * per_head)  # this rank's heads' rows
        kv_b = dense_tensor(weights.read_shard(f"{self.prefix}.kv_b_proj.weight", rows))
        kv_b = kv_b.view(self.num_heads, per_head, mla.kv_lora_rank)
        self.w_uk.copy_(kv_b[:, : mla.qk_nope_head_dim])
        self.w_uv.copy_(kv_b[:, mla.qk_nope_head_dim :])

