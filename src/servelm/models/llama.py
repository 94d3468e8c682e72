"""The Llama family (Llama 2/3, Mistral, SmolLM, Qwen2 with q/k/v bias, Qwen3 with q/k norms), its
mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: models/moe.py) and DeepSeek-V2/V3 (latent attention,
models/mla.py, and its experts) for a flattened batch.

Every forward takes the tokens of many requests end to end, `[num_tokens]`, with one
position per token; which token belongs to which request, and where its K/V live,
is the attention metadata's business. The model never sees a padded [batch, seq].

q/k/v and gate/up are each one fused matmul (one weight read instead of three or two);
`load_weights` copies the checkpoint's separate tensors into their rows, one tensor at a time.
How each linear layer stores its weight is its `LinearMethod`, chosen by the model factory
(`linear_method(parts, columns)`, called once per layer with the checkpoint prefixes it is made of).

Tensor parallelism (`tp`, a `GroupMember`; see models/sharding.py for who holds what): every
layer is built with this rank's sizes and reads only its rows / columns of each tensor. Per layer

    hidden ─▶ qkv_proj (my q heads | my k heads | my v heads) ─▶ attention over my heads
           ─▶ o_proj (my columns) ─▶ all-reduce ─▶ gate_up_proj (my gate | my up) ─▶ down_proj
           (my columns) ─▶ all-reduce

and the embedding and LM head split the vocabulary (compute_logits all-gathers the full logits on
every rank). One rank issues no collective: each helper is the identity there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from servelm.attention.backend import AttentionBackend, AttentionMetadata
from servelm.attention.kv_storage import LayerKVCache
from servelm.attention.torch_backend import TorchAttentionMetadata
from servelm.models.arch import ModelArchConfig
from servelm.models.fused_decode import FusedDecodeLayers
from servelm.models.fused_ops import TORCH_OPS, NormRotaryOps, Rotate, torch_silu_mul
from servelm.models.layers import Linear, RMSNorm, VocabParallelEmbedding
from servelm.models.linear_methods import LinearMethodChooser, all_dense
from servelm.models.mla import LatentAttention
from servelm.models.moe import SparseMoE
from servelm.models.moe_weights import shared_expert_prefix
from servelm.models.rotary import RotaryEmbedding
from servelm.models.sharding import ModelShard, whole
from servelm.models.weights import CheckpointWeights, Weight, dense_tensor
from servelm.parallel.groups import SINGLE_RANK, GroupMember, all_gather_last_dim


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, prefix: str,
                 linear_method: LinearMethodChooser, shard: ModelShard) -> None:  # fmt: skip
        super().__init__()
        # This rank's heads (all of them alone); its q heads are the groups of its KV heads.
        self.num_heads = shard.attention.num_heads
        self.num_kv_heads = shard.attention.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_rows = whole(shard.q_rows(arch.head_dim), arch.num_attention_heads * arch.head_dim)
        kv_rows = whole(shard.kv_rows(arch.head_dim), arch.num_key_value_heads * arch.head_dim)
        qkv_parts = tuple(f"{prefix}.{name}_proj" for name in "qkv")
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, arch.attention_bias, qkv_parts,
                               linear_method(qkv_parts, None), rows=(q_rows, kv_rows, kv_rows))  # fmt: skip
        o_parts = (f"{prefix}.o_proj",)
        self.o_proj = Linear(self.q_size, arch.hidden_size, False, o_parts, linear_method(o_parts, q_rows),
                             columns=q_rows, reduce=shard.tp)  # fmt: skip
        self.rotary = RotaryEmbedding(self.head_dim, arch.rope_theta, arch.rope_scaling)
        self.backend = backend
        self.scale = self.head_dim**-0.5
        # Qwen3: each q and k head RMS-normed over its head_dim before the rotation.
        self.prefix = prefix
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def load(self, weights: CheckpointWeights) -> None:
        self.qkv_proj.load(weights)
        self.o_proj.load(weights)
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.weight.copy_(dense_tensor(weights[f"{self.prefix}.q_norm.weight"]))
            self.k_norm.weight.copy_(dense_tensor(weights[f"{self.prefix}.k_norm.weight"]))

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D/2] each (RotaryEmbedding.cos_sin)
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: LayerKVCache | None,
        metadata: AttentionMetadata,
        rotate: Rotate,  # NormRotaryOps.rotate (may rotate qkv's q|k columns in place)
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 KVH) * D]: q | k | v
        qk_size = self.q_size + self.kv_size
        # q and k sit side by side, so one rotation covers both heads' worth: [T, H + KVH, D].
        qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        qk = rotate(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, prefix: str, linear_method: LinearMethodChooser,
                 shard: ModelShard, intermediate_size: int | None = None) -> None:  # fmt: skip
        """`intermediate_size`: a MoE layer's shared expert of that width, this rank's columns of it
        (shard.shared_expert), its output left for the MoE layer's one all-reduce; None: the model's
        MLP, this rank's columns of it, all-reduced here."""
        super().__init__()
        if intermediate_size is not None:
            self.intermediate_size, columns = len(shard.shared_expert), whole(shard.shared_expert, intermediate_size)
            shard = dataclasses.replace(shard, tp=SINGLE_RANK)  # no all-reduce of its own
        else:
            self.intermediate_size = len(shard.mlp)  # this rank's columns
            columns = whole(shard.mlp, arch.intermediate_size)
        gate_up_parts = (f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.intermediate_size, False, gate_up_parts,
                                   linear_method(gate_up_parts, None), rows=(columns, columns))  # fmt: skip
        down_parts = (f"{prefix}.down_proj",)
        self.down_proj = Linear(self.intermediate_size, arch.hidden_size, False, down_parts,
                                linear_method(down_parts, columns), columns=columns, reduce=shard.tp)  # fmt: skip

    def forward(
        self, x: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor] = torch_silu_mul
    ) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))  # gate_up: [T, 2I] = gate | up

    def load(self, weights: CheckpointWeights) -> None:
        self.gate_up_proj.load(weights)
        self.down_proj.load(weights)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, index: int,
                 linear_method: LinearMethodChooser, shard: ModelShard) -> None:  # fmt: skip
        super().__init__()
        prefix = f"model.layers.{index}"
        self.prefix = prefix  # where its tensors sit in the checkpoint
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        attention = LatentAttention if arch.mla is not None else LlamaAttention
        self.self_attn: LlamaAttention | LatentAttention = attention(arch, backend, f"{prefix}.self_attn", linear_method, shard)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: LlamaMLP | SparseMoE
        if arch.moe is not None and index in arch.moe.sparse_layers:
            shared = arch.moe.shared_expert_intermediate_size
            shared_prefix = shared_expert_prefix(arch.moe, prefix)
            shared_expert = LlamaMLP(arch, shared_prefix, linear_method, shard, shared) if shared else None
            self.mlp = SparseMoE(arch, prefix, shared_expert, shard)
        else:
            self.mlp = LlamaMLP(arch, f"{prefix}.mlp", linear_method, shard)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: LayerKVCache | None, metadata: AttentionMetadata,
                ops: NormRotaryOps) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """hidden: the previous layer's MLP output (the embedding at layer 0, with residual None);
        residual: the running sum before it. Returns (this layer's MLP output, the sum before it):
        the residual add of each sublayer is fused into the norm that reads its result."""
        normed, residual = self.input_layernorm.add(hidden, residual, ops)
        attn = self.self_attn(rope, normed, kv_cache, metadata, ops.rotate)
        normed, residual = self.post_attention_layernorm.add(attn, residual, ops)
        return self.mlp(normed, ops.silu_mul), residual


@dataclass
class PartialForward:
    """A forward stopped between two decoder layers (layered prefill, worker/layered_chunks.py):
    what the next layer reads. Made by `LlamaForCausalLM.begin`, advanced by `run_layers`."""

    hidden: torch.Tensor  # [T, hidden]: the last layer's MLP output (the embedding before layer 0)
    residual: torch.Tensor | None  # [T, hidden]: the running sum before it; None before layer 0
    rope: tuple[torch.Tensor, torch.Tensor]  # the tokens' rotary cos / sin, computed once for every layer
    next_layer: int = 0  # the first layer not yet run


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend,
                 linear_method: LinearMethodChooser = all_dense, tp: GroupMember = SINGLE_RANK) -> None:  # fmt: skip
        super().__init__()
        self.arch = arch
        self.shard = ModelShard.of(arch, tp)  # what this rank holds (everything alone)
        self.embed_tokens = VocabParallelEmbedding(arch.hidden_size, self.shard)
        layers = [LlamaDecoderLayer(arch, backend, i, linear_method, self.shard) for i in range(arch.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        # The same modules, typed (a tuple is not registered again as a submodule).
        self.decoder_layers: tuple[LlamaDecoderLayer, ...] = tuple(layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # A tied head is the embedding matrix: its part is the embedding's tensor.
        head_parts = ("model.embed_tokens",) if arch.tie_word_embeddings else ("lm_head",)
        vocab = whole(self.shard.vocab, arch.vocab_size)
        self.lm_head = Linear(arch.hidden_size, len(self.shard.vocab), False, head_parts,
                              linear_method(head_parts, None), rows=(vocab,))  # fmt: skip
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Who computes the norms and rotations; the factory picks by device (fused_ops.select_ops).
        self.norm_rotary_ops = TORCH_OPS
        # Small CPU decode steps' layers in one compiled call where the model allows it (set by the
        # factory once the weights are in: fused_decode.FusedDecodeLayers.of); None: op by op always.
        self.fused_decode: FusedDecodeLayers | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long, position of each token within its request
        metadata: AttentionMetadata,
        kv_caches: Sequence[LayerKVCache] | None = None,  # one [2, blocks, block_size, KVH, D] per layer
        num_layers: int | None = None,  # run only the first N decoder layers (a self-speculative draft)
    ) -> torch.Tensor:  # [T, hidden]
        state = self.begin(input_ids, positions)
        fused = self.fused_decode
        if fused is not None and num_layers != 0 and fused.accepts(state.hidden.shape[0], metadata, kv_caches):
            assert kv_caches is not None and isinstance(metadata, TorchAttentionMetadata)  # accepts checked
            hidden, residual = fused.run(state.hidden, state.rope, metadata, kv_caches, num_layers)
            return self.norm.add(hidden, residual, self.norm_rotary_ops)[0]
        end = len(self.decoder_layers) if num_layers is None else num_layers
        return self.finish(self.run_layers(state, metadata, kv_caches, end))

    @torch.inference_mode()
    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> PartialForward:
        """The embedding of `input_ids` ([T] long) at `positions` ([T] long), before layer 0."""
        hidden = self.embed_tokens(input_ids)
        # Every layer rotates by the same angles: computed once per forward, not once per layer.
        rope = self.decoder_layers[0].self_attn.rotary.cos_sin(positions, hidden.dtype)
        return PartialForward(hidden, None, rope)

    @torch.inference_mode()
    def run_layers(self, state: PartialForward, metadata: AttentionMetadata,
                   kv_caches: Sequence[LayerKVCache] | None, end_layer: int) -> PartialForward:  # fmt: skip
        """Layers [state.next_layer, end_layer) over `state` (writing their K/V); returns the state
        after them. The same arithmetic whether a forward runs its layers in one call or in several."""
        hidden, residual = state.hidden, state.residual
        for i in range(state.next_layer, end_layer):
            kv_cache = None if kv_caches is None else kv_caches[i]
            hidden, residual = self.decoder_layers[i](state.rope, hidden, residual, kv_cache, metadata,
                                                      self.norm_rotary_ops)  # fmt: skip
        return PartialForward(hidden, residual, state.rope, max(end_layer, state.next_layer))

    @torch.inference_mode()
    def finish(self, state: PartialForward) -> torch.Tensor:
        """The final norm after the last layer run: [T, hidden], what compute_logits reads."""
        return self.norm.add(state.hidden, state.residual, self.norm_rotary_ops)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] → logits [N, vocab] in float32 (sampling wants full precision), the
        full vocabulary on every tensor-parallel rank (each computes its rows, then all gather)."""
        logits = self.lm_head(hidden).float()  # [N, vocab shard]
        return all_gather_last_dim(logits, self.shard.tp, list(self.shard.vocab_sizes))

    def load_weights(self, weights: Mapping[str, Weight]) -> None:
        """Copy Hugging Face-named tensors in, one at a time, each converted to its parameter's dtype
        and device; fused q/k/v and gate/up are written part by part into their rows. Shapes were
        validated by the caller. Reads every tensor once (a lazy source is read tensor by tensor),
        and of each only this rank's shard (the loaders read a shard without the rest)."""
        weights = CheckpointWeights.from_tensors(weights)
        vocab = whole(self.shard.vocab, self.arch.vocab_size)
        with torch.no_grad():
            if not self.arch.tie_word_embeddings:  # tied, the head's load below fills the shared matrix
                self.embed_tokens.weight.copy_(dense_tensor(weights.read_shard("model.embed_tokens.weight", vocab)))
            self.norm.weight.copy_(dense_tensor(weights["model.norm.weight"]))
            self.lm_head.load(weights)
            for layer in self.decoder_layers:
                layer.input_layernorm.weight.copy_(dense_tensor(weights[f"{layer.prefix}.input_layernorm.weight"]))
                post_norm = weights[f"{layer.prefix}.post_attention_layernorm.weight"]
                layer.post_attention_layernorm.weight.copy_(dense_tensor(post_norm))
                layer.self_attn.load(weights)
                layer.mlp.load(weights)
