"""What one tensor-parallel rank holds of a Llama-family model (servelm.parallel.tensor's split
applied to an architecture), and the rows and columns of each checkpoint tensor that it reads.

    column-parallel (output rows split, no communication):   qkv_proj, gate_up_proj, lm_head
    row-parallel (input columns split, outputs all-reduced):  o_proj, down_proj
    vocab-parallel embedding (rows split, lookups all-reduced)
    expert-parallel (a mixture of experts' routed experts split whole, in id order; each rank runs
    its experts on the tokens routed to them, its shared expert's columns, and one all-reduce sums
    the layer: models/moe.py)
    latent attention (heads split as q heads are; the latent and the RoPE key, shared by every
    head, computed and cached whole on every rank: models/mla.py)

One rank (`tp.size == 1`) holds everything: every range below is the whole dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.models.arch import ModelArchConfig
from servelm.models.gguf_blocks import BLOCK
from servelm.parallel.groups import GroupMember
from servelm.parallel.tensor import AttentionShard, attention_shards, mlp_shards, split_ranges, vocab_shards


@dataclass(frozen=True)
class ModelShard:
    """One rank's part of a model: its heads, MLP columns and vocabulary rows (global ids), and the
    group its row-parallel layers, embedding and LM head communicate over."""

    tp: GroupMember
    attention: AttentionShard
    mlp: range  # intermediate columns: rows of gate and of up, input columns of down
    vocab: range  # rows of the embedding and of the LM head
    vocab_sizes: tuple[int, ...]  # every rank's vocabulary rows, rank order (the logits all-gather)
    experts: range = range(0)  # a mixture of experts' routed experts this rank holds (ids)
    shared_expert: range = range(0)  # the shared expert's intermediate columns this rank holds

    @classmethod
    def of(cls, arch: ModelArchConfig, tp: GroupMember) -> ModelShard:
        """Raises ValueError naming the sizes when `arch` cannot be split over `tp.size` ranks."""
        # Column shards of down_proj stored as GGUF blocks must fall on blocks of 32 inputs.
        aligned = arch.intermediate_size % BLOCK == 0 and arch.intermediate_size // BLOCK >= tp.size
        vocab = vocab_shards(arch.vocab_size, tp.size)
        moe = arch.moe
        experts = split_ranges(moe.num_experts, tp.size, what="experts")[tp.rank] if moe is not None else range(0)
        shared = moe.shared_expert_intermediate_size if moe is not None else 0
        return cls(
            tp=tp,
            attention=attention_shards(arch.num_attention_heads, arch.num_key_value_heads, tp.size)[tp.rank],
            mlp=mlp_shards(arch.intermediate_size, tp.size, BLOCK if aligned else 1)[tp.rank],
            vocab=vocab[tp.rank],
            vocab_sizes=tuple(len(r) for r in vocab),
            experts=experts,
            shared_expert=mlp_shards(shared, tp.size)[tp.rank] if shared else range(0),
        )

    def q_rows(self, head_dim: int) -> range:
        """Rows of q_proj (and columns of o_proj) this rank keeps."""
        return range(self.attention.q_heads.start * head_dim, self.attention.q_heads.stop * head_dim)

    def kv_rows(self, head_dim: int) -> range:
        """Rows of k_proj and of v_proj this rank keeps."""
        return range(self.attention.kv_heads.start * head_dim, self.attention.kv_heads.stop * head_dim)


def local_num_kv_heads(arch: ModelArchConfig, tp: GroupMember) -> int:
    """KV heads one rank's attention stores: what its KV pool is allocated with (latent attention:
    its one latent head, whole on every rank)."""
    if arch.mla is not None:
        return arch.kv_cache_heads
    return ModelShard.of(arch, tp).attention.num_kv_heads


def whole(shard: range, total: int) -> range | None:
    """None when `shard` is the whole dimension (one rank: the loaders read the tensor as it is)."""
    return None if (shard.start, shard.stop) == (0, total) else shard
