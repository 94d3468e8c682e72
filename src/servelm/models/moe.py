"""Routed experts in place of a layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and V3): `SparseMoE`.

Per step, for the flattened batch x [T, hidden]:

    router logits x @ Wr^T [T, E] ─▶ softmax (float32) ─▶ top-k experts per token (weights
    renormalised to sum 1 where the family does) ─▶ the T·k (token, expert) pairs sorted by expert
    ─▶ for each expert that got tokens: its rows of x gathered, one SwiGLU GEMM pair over them
    ([n, hidden] @ [hidden, 2I] ─▶ silu·mul ─▶ @ [I, hidden]), scaled by the pair's weight
    ─▶ summed back into each token's row (index_add)

On CPU, a step of up to KERNEL_MAX_TOKENS tokens does the sorted pairs' experts in one compiled
call instead (csrc/moe.c: the same math, no Python loop over experts).

Experts that no token chose cost nothing: a step reads the weights of the experts it uses, so
its cost follows the active parameters (a decode step of a few tokens touches at most T·k
experts), not the total. One host sync a step reads the per-expert counts, so that the groups
are slices of one sorted order rather than a mask per expert.

The experts' weights are two stacked tensors ([E, 2I, hidden] gate|up and [E, hidden, I] down):
each expert's slice is the same matrix the checkpoint stores as separate tensors per expert
(`load` copies them in one at a time). A shared expert (Qwen2-MoE, DeepSeek) is a dense MLP every
token passes through, added (Qwen2-MoE's scaled by sigmoid(x @ Wg^T) first). DeepSeek-V3 scores
experts by sigmoid, V2 by softmax, and both choose within the best groups (`route_grouped`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from servelm.kernels import cpu as cpu_kernels
from servelm.models.arch import DEEPSEEK_NAMINGS, ModelArchConfig, MoEConfig
from servelm.models.moe_weights import expert_tensor_names, router_tensor_name, routing_bias_name
from servelm.models.sharding import ModelShard
from servelm.models.weights import CheckpointWeights, dense_tensor
from servelm.parallel.groups import all_reduce_sum

if TYPE_CHECKING:
    from servelm.models.llama import LlamaMLP

# Up to this many tokens (decode steps, short chunks) the routed experts run in one compiled call on
# CPU, each expert's weight rows read once for its few tokens; longer chunks give each expert enough
# rows for the per-expert GEMMs to be worth their calls.
KERNEL_MAX_TOKENS = 32


def route(router_logits: torch.Tensor, moe: MoEConfig,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(weights [T, k] in the logits' dtype, expert ids [T, k]) of each token's top-k experts:
    softmax in float32 over all experts, the k largest, renormalised where the family does; or
    DeepSeek's choice within the best groups (route_grouped; V3 adds `bias` ([E]) to choose)."""
    if moe.naming in DEEPSEEK_NAMINGS:
        return route_grouped(router_logits, moe, bias)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def route_grouped(router_logits: torch.Tensor, moe: MoEConfig,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """DeepSeek's choice: the experts' scores in float32 (V3: sigmoid; V2: softmax over all), the
    experts split into num_groups groups, a group scored by the sum of its two best biased scores
    (V3) or by its best score (V2), only the topk_group best groups' experts eligible; the top_k of
    those by biased score; weighted by their unbiased scores, renormalised where norm_topk_prob,
    times routed_scaling_factor."""
    logits = router_logits.float()
    sigmoid = moe.scoring == "sigmoid"
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)  # [T, E]
    choice = scores if bias is None else scores + bias.float()
    num_tokens = choice.shape[0]
    grouped = choice.view(num_tokens, moe.num_groups, -1)
    if sigmoid:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.amax(dim=-1)
    best_groups = torch.topk(group_scores, moe.topk_group, dim=-1).indices
    eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = grouped.masked_fill(~eligible.unsqueeze(-1), float("-inf")).view(num_tokens, -1)
    experts = torch.topk(choice, moe.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts


class SparseMoE(nn.Module):
    """Expert parallelism (`shard.tp` of several ranks): this rank holds the experts `shard.experts`
    (whole, ids in order) and its columns of the shared expert; every rank routes every token (the
    router is replicated, so all agree), runs its own experts on the pairs routed to them and its
    shared-expert part, and one all-reduce sums the layer's output over the ranks: tokens are
    replicated after attention's all-reduce, so choosing a rank's pairs is the dispatch and the
    all-reduce is the combine."""

    def __init__(self, arch: ModelArchConfig, prefix: str, shared_expert: LlamaMLP | None, shard: ModelShard) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.moe = moe
        self.prefix = prefix
        self.experts = shard.experts if shard.tp.is_parallel else range(moe.num_experts)
        self.tp = shard.tp
        width, num_local = moe.expert_intermediate_size, len(self.experts)
        self.router = nn.Parameter(torch.empty(moe.num_experts, arch.hidden_size))
        self.gate_up = nn.Parameter(torch.empty(num_local, 2 * width, arch.hidden_size))  # gate | up rows
        self.down = nn.Parameter(torch.empty(num_local, arch.hidden_size, width))
        self.shared_expert = shared_expert  # a dense MLP (Qwen2-MoE, DeepSeek-V3), None for the others
        gated = shared_expert is not None and moe.naming == "qwen2_moe"
        self.shared_gate = nn.Parameter(torch.empty(1, arch.hidden_size)) if gated else None
        self.routing_bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.scoring == "sigmoid" else None
        # A few tokens' experts in one compiled call on CPU (csrc/moe.c); None: the per-expert loop.
        self._kernels = cpu_kernels.load()

    def forward(self, x: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        # DeepSeek scores in float32 from the start, as its reference does.
        deepseek = self.moe.naming in DEEPSEEK_NAMINGS
        logits = F.linear(x.float(), self.router.float()) if deepseek else F.linear(x, self.router)
        weights, experts = route(logits, self.moe, self.routing_bias)  # [T, k] each
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)  # the (token, slot) pairs grouped by expert
        token_of_pair = order // self.moe.top_k
        weight_of_pair = weights.reshape(-1)[order].unsqueeze(-1)
        counts = torch.bincount(flat_experts, minlength=self.moe.num_experts).tolist()  # the one host sync
        out = torch.zeros_like(x)
        start = sum(counts[: self.experts.start])  # this rank's experts' pairs follow the lower ids'
        local_counts = counts[self.experts.start : self.experts.stop]
        if (self._kernels is not None and x.is_cpu and x.shape[0] <= KERNEL_MAX_TOKENS
                and x.dtype == self.gate_up.dtype == torch.float32):  # fmt: skip
            pairs = sum(local_counts)
            if pairs:
                offsets = torch.tensor([0, *itertools.accumulate(local_counts)], dtype=torch.int64)
                self._kernels.moe_experts_(out, x.contiguous(), self.gate_up.data, self.down.data,
                                           token_of_pair[start : start + pairs].contiguous(),
                                           weight_of_pair[start : start + pairs].reshape(-1).float().contiguous(), offsets)  # fmt: skip
            return self._finish(x, out, silu_mul)
        for local, count in enumerate(local_counts):
            if count == 0:
                continue
            tokens = token_of_pair[start : start + count]
            hidden = silu_mul(F.linear(x[tokens], self.gate_up[local]))  # [n, I]
            out.index_add_(0, tokens, (F.linear(hidden, self.down[local]) * weight_of_pair[start : start + count]).to(x.dtype))
            start += count
        return self._finish(x, out, silu_mul)

    def _finish(self, x: torch.Tensor, out: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The routed experts' sum `out`, plus the shared expert's part, summed over the ranks."""
        if self.shared_expert is not None:
            shared = self.shared_expert(x, silu_mul)  # this rank's columns' part (summed below)
            out += shared if self.shared_gate is None else torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return all_reduce_sum(out, self.tp) if self.tp.is_parallel else out

    def load(self, weights: CheckpointWeights) -> None:
        """The router and every expert's three tensors, one tensor read at a time, into the stacks."""
        moe, width = self.moe, self.moe.expert_intermediate_size
        self.router.copy_(dense_tensor(weights[router_tensor_name(moe, self.prefix)]))
        for local, expert in enumerate(self.experts):  # this rank's experts only: the others are not read
            gate, up, down = expert_tensor_names(moe, self.prefix, expert)
            self.gate_up[local, :width].copy_(dense_tensor(weights[gate]))
            self.gate_up[local, width:].copy_(dense_tensor(weights[up]))
            self.down[local].copy_(dense_tensor(weights[down]))
        if self.routing_bias is not None:
            self.routing_bias.copy_(dense_tensor(weights[routing_bias_name(self.prefix)]))
        if self.shared_gate is not None:
            self.shared_gate.copy_(dense_tensor(weights[f"{self.prefix}.mlp.shared_expert_gate.weight"]))
        if self.shared_expert is not None:
            self.shared_expert.load(weights)
