"""Batched LoRA in the forward pass: one step mixes requests of different adapters and of the base
model, with no weight merged into the base (Punica's segmented gather-matmul, SGMV, in torch).

Every projection an adapter may target (q/k/v fused, o, gate/up fused, down) carries a `LoRALinear`:
its adapters' weights stacked by slot, a fixed layout ([max_loras, ...], allocated once):

    A [slots, W, in]      slot s: its parts' A matrices one after another (part p at rows p*r .. (p+1)*r)
    B [slots, out, W]     the matching columns; part p's output rows only (block diagonal), scaling folded in
    W = parts x max_lora_rank; a slot of rank r uses its first parts x r columns only

A forward's rows come in runs of one request each, so a step's LoRA batch is a list of segments
(slot, first row, end row) with neighbours of one slot merged; each segment adds
(x[rows] @ A[s, :w]^T) @ B[s, :, :w]^T to the base layer's output. Rows of the base model (no
adapter) are in no segment. The layer's cost is one pair of small matmuls per segment: what the
adapters' rows need, nothing for the base model's requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from servelm.lora.adapter import LoRAAdapter
from servelm.models.layers import Linear
from servelm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

NO_ADAPTER = -1  # a request of the base model: its rows are in no segment


@dataclass(frozen=True)
class LoRASegment:
    slot: int
    start: int  # first row of the forward's flattened batch
    end: int  # one past the last


@dataclass(frozen=True)
class LoRABatch:
    """Which rows of one forward run which adapter slot."""

    segments: tuple[LoRASegment, ...]

    @classmethod
    def of(cls, slots: Sequence[int], num_rows: Sequence[int]) -> LoRABatch:
        """From each request's slot (NO_ADAPTER for the base model) and its rows, in batch order."""
        segments: list[LoRASegment] = []
        start = 0
        for slot, rows in zip(slots, num_rows, strict=True):
            if slot != NO_ADAPTER and rows:
                if segments and segments[-1].slot == slot and segments[-1].end == start:
                    segments[-1] = LoRASegment(slot, segments[-1].start, start + rows)
                else:
                    segments.append(LoRASegment(slot, start, start + rows))
            start += rows
        return cls(tuple(segments))


@dataclass
class LoRAContext:
    """The LoRA batch of the forward in progress, shared by every LoRALinear of a model (None: no
    adapter rows in it; the layers add nothing and the fused decode path may run)."""

    batch: LoRABatch | None = None


class LoRALinear:
    """The stacked adapter weights of one Linear (whose `parts` are the checkpoint modules it fuses)."""

    def __init__(self, linear: Linear, part_rows: Sequence[int], max_loras: int, max_rank: int,
                 context: LoRAContext, device: torch.device) -> None:  # fmt: skip
        self.parts = linear.parts
        self.part_rows = tuple(part_rows)  # output rows of each part, in order
        width = len(self.parts) * max_rank
        self.a = torch.zeros(max_loras, width, linear.in_features, device=device)
        self.b = torch.zeros(max_loras, linear.out_features, width, device=device)
        self.widths = [0] * max_loras  # columns slot s uses: parts x its rank (0: no adapter there)
        self.context = context

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Slot `slot` holds `adapter`'s matrices for these parts (zeros where it targets none of them)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.widths[slot] = 0
        if adapter is None or not any(part in adapter.weights for part in self.parts):
            return
        rank, row = adapter.rank, 0
        for p, (part, rows) in enumerate(zip(self.parts, self.part_rows, strict=True)):
            if part in adapter.weights:
                a, b = adapter.weights[part]
                self.a[slot, p * rank : (p + 1) * rank].copy_(a)
                self.b[slot, row : row + rows, p * rank : (p + 1) * rank].copy_(b * adapter.scaling)
            row += rows
        self.widths[slot] = len(self.parts) * rank

    def add_delta(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out[rows] += (x[rows] @ A^T) @ B^T for each segment of the forward's batch, in place."""
        batch = self.context.batch
        if batch is None:
            return
        for segment in batch.segments:
            width = self.widths[segment.slot]
            if width == 0:
                continue
            rows = slice(segment.start, segment.end)
            a, b = self.a[segment.slot, :width], self.b[segment.slot, :, :width]
            out[rows] += ((x[rows] @ a.T.to(x.dtype)) @ b.T.to(x.dtype)).to(out.dtype)


@dataclass
class LoRAModel:
    """Every LoRALinear of a model, and their shared context."""

    context: LoRAContext
    layers: list[LoRALinear] = field(default_factory=list)

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for layer in self.layers:
            layer.set_slot(slot, adapter)


def attach_lora(model: LlamaForCausalLM, max_loras: int, max_rank: int) -> LoRAModel:
    """Give every targetable projection of `model` (one rank, dense attention and MLP) its stacked
    slots, empty; the model's fused decode layers are turned off (they cannot add the adapters' rows).
    Raises ValueError for models LoRA is not served on."""
    arch = model.arch
    if arch.moe is not None or arch.mla is not None or model.shard.tp.is_parallel:
        raise ValueError(f"LoRA is served on one rank over dense attention models, not {arch.architecture}"
                         + (" at tensor parallelism" if model.shard.tp.is_parallel else ""))  # fmt: skip
    lora = LoRAModel(LoRAContext())
    device = model.embed_tokens.weight.device
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    for layer in model.decoder_layers:
        attention, mlp = layer.self_attn, layer.mlp
        assert isinstance(attention, LlamaAttention) and isinstance(mlp, LlamaMLP)
        for linear, rows in ((attention.qkv_proj, (q, kv, kv)), (attention.o_proj, (arch.hidden_size,)),
                             (mlp.gate_up_proj, (arch.intermediate_size,) * 2), (mlp.down_proj, (arch.hidden_size,))):  # fmt: skip
            lora_linear = LoRALinear(linear, rows, max_loras, max_rank, lora.context, device)
            linear.lora = lora_linear
            lora.layers.append(lora_linear)
    model.fused_decode = None
    return lora
