"""The layers every model family here is built of: `Linear` (a weight made of checkpoint tensors,
stored as its LinearMethod says, sharded for tensor parallelism), `RMSNorm`, and the vocabulary-
parallel embedding. models/llama.py (Llama family, mixtures of experts) and models/mla.py (latent
attention) compose them."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from servelm.models.fused_ops import NormRotaryOps, torch_rms_norm
from servelm.models.linear_methods import DENSE, LinearMethod
from servelm.models.sharding import ModelShard
from servelm.models.weights import CheckpointWeights, dense_tensor
from servelm.parallel.groups import GroupMember, all_reduce_sum


class OutputDelta(Protocol):
    """What a Linear adds to its output beyond x @ W^T: a LoRA adapter batch's rows (servelm.lora)."""

    def add_delta(self, out: torch.Tensor, x: torch.Tensor) -> None: ...


class Linear(nn.Module):
    """x @ W^T (+ b), W made of the checkpoint tensors `parts` stacked by rows, stored as `method` says.

    `parts` are checkpoint prefixes ("model.layers.0.self_attn.q_proj"): `load` reads
    `<part>.weight` (and `<part>.bias`) for each, in order, into consecutive rows.
    Tensor-parallel shards (None: the whole tensor): `rows[i]`, the rows of part i this rank keeps
    (column-parallel); `columns`, the input columns it keeps (row-parallel: its output is summed over
    `reduce`, and only the group's rank 0 keeps a bias, so that it is added once).
    `in_features` / `out_features` are this rank's.
    """

    # Registered by the method's create_weights (which ones depends on the method).
    weight: torch.Tensor  # [N, K] in the model's dtype
    blocks: torch.Tensor  # [N, K / 32, block bytes] uint8, the GGUF file's blocks (block methods only)
    codes: torch.Tensor  # [N, K] uint8, FP8 e4m3 codes' bytes (FP8 block methods only)
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, parts: tuple[str, ...],
                 method: LinearMethod = DENSE, *, rows: tuple[range | None, ...] | None = None,
                 columns: range | None = None, reduce: GroupMember | None = None) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts = parts
        self.part_rows = rows if rows is not None else (None,) * len(parts)
        self.columns = columns
        # None alone: one rank runs exactly the unsharded layer, no collective.
        self.reduce = reduce if reduce is not None and reduce.is_parallel else None
        self.method = method
        self.lora: OutputDelta | None = None  # set by servelm.lora.layers.attach_lora
        method.create_weights(self)
        keeps_bias = bias and (self.reduce is None or self.reduce.rank == 0)
        self.bias = nn.Parameter(torch.empty(out_features)) if keeps_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        if self.lora is not None:
            self.lora.add_delta(out, x)
        return out if self.reduce is None else all_reduce_sum(out, self.reduce)

    def load(self, weights: CheckpointWeights) -> None:
        """Copy each part's tensor (this rank's rows and columns of it) into its rows: one tensor
        read at a time, no concatenation."""
        row = 0
        for part, rows in zip(self.parts, self.part_rows, strict=True):
            weight = weights.read_shard(f"{part}.weight", rows, self.columns)  # [rows kept, in_features]
            self.method.load_rows(self, weight, row)
            if self.bias is not None:
                bias = dense_tensor(weights.read_shard(f"{part}.bias", rows))
                self.bias[row : row + weight.shape[0]].copy_(bias)
            row += weight.shape[0]
        if row != self.out_features:
            raise ValueError(f"parts {self.parts} have {row} rows in all, the layer {self.out_features}")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_rms_norm(x, self.weight, self.eps)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor | None, ops: NormRotaryOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual) by `ops` (one fused pass on the Triton set);
        residual None (the first layer): (self(x), x)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows `shard.vocab` of [vocab, hidden]. Alone, exactly nn.Embedding's lookup; in a
    group each rank looks up the ids it holds (zeros for the others) and the sum is every row."""

    def __init__(self, hidden_size: int, shard: ModelShard) -> None:
        super().__init__()
        self.vocab = shard.vocab
        self.tp = shard.tp
        self.weight = nn.Parameter(torch.empty(len(shard.vocab), hidden_size))  # [vocab shard, hidden]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce_sum(hidden.masked_fill_(outside.unsqueeze(-1), 0.0), self.tp)
