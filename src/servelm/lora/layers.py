"""Batched LoRA in the forward pass: one step mixes requests of different adapters and of the base
model, with no weight merged into the base (Punica's SGMV and BGMV, in torch).

Every projection an adapter may target (q/k/v fused, o, gate/up fused, down) carries a `LoRALinear`:
its adapters' weights stacked by slot, a fixed layout ([max_loras, ...], allocated once):

    A [slots, W, in]      slot s: its parts' A matrices one after another (part p at rows p*r .. (p+1)*r)
    Bt [slots, W, out]    B^T: the matching rows; part p's outputs only (block diagonal), scaling folded in
    W = parts x max_lora_rank; a slot of rank r uses its first parts x r columns only (the rest zero)

A forward's rows come in runs of one request each, so a step's LoRA batch is a list of segments
(slot, first row, end row) with neighbours of one slot merged. Rows of the base model (no adapter)
are in no segment. Two ways to add the adapters' rows, by the batch's shape:

    segments   per segment, (x[rows] @ A[s, :w]^T) @ Bt[s, :w]: one pair of small matmuls each,
               what the adapters' rows need (prefill chunks: many rows, few segments)
    row-wise   few rows (decode steps), where a loop of torch ops per segment costs more than its
               FLOPs: on CPU one call for the whole batch (csrc/lora.c, Punica's BGMV: each row its
               own adapter's columns only); elsewhere every slot at once, (x @ A_all^T) * mask @
               Bt_all, the mask keeping each row's own slot's columns (three ops, max_loras x the
               FLOPs). 8 adapters in a batch of 8 as segments took decode to 0.53x the base model's
               throughput on 2 CPU cores, and the masked form no better (its FLOPs, at max_loras 8,
               rival the base layer's on the default model)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from servelm.kernels import cpu as cpu_kernels
from servelm.kernels.decode_layers import StackedLoRA
from servelm.lora.adapter import LoRAAdapter
from servelm.models.fused_decode import FusedDecodeLayers
from servelm.models.layers import Linear
from servelm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

NO_ADAPTER = -1  # a request of the base model: its rows are in no segment
# A forward of at most this many rows adds the adapters' rows row-wise (decode steps, short chunks):
# beyond it a prompt chunk's segments are GEMMs worth their call.
ROWWISE_MAX_ROWS = 64


@dataclass(frozen=True)
class LoRASegment:
    slot: int
    start: int  # first row of the forward's flattened batch
    end: int  # one past the last


@dataclass(frozen=True)
class LoRABatch:
    """Which rows of one forward run which adapter slot."""

    segments: tuple[LoRASegment, ...]
    num_rows: int = 0  # of the whole forward, base rows included

    @property
    def rowwise(self) -> bool:
        """Whether the layers add the adapters' rows row by row (see the module's docstring)."""
        return self.num_rows <= ROWWISE_MAX_ROWS

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
        return cls(tuple(segments), start)


@dataclass
class LoRAContext:
    """The LoRA batch of the forward in progress, shared by every LoRALinear of a model (None: no
    adapter rows in it; the layers add nothing and the fused decode path may run)."""

    max_loras: int = 1
    _batch: LoRABatch | None = None
    _masks: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict)  # the batch's, by width
    _row_slots: torch.Tensor | None = None  # the batch's slot per row (NO_ADAPTER for base rows), int64 on CPU

    @property
    def batch(self) -> LoRABatch | None:
        return self._batch

    @batch.setter
    def batch(self, batch: LoRABatch | None) -> None:
        self._batch = batch
        self._masks.clear()
        self._row_slots = None

    def row_slots(self) -> torch.Tensor:
        """[rows] int64: each row's slot, NO_ADAPTER for the base model's (built once per forward)."""
        if self._row_slots is None:
            assert self._batch is not None
            slots = torch.full((self._batch.num_rows,), NO_ADAPTER, dtype=torch.int64)
            for segment in self._batch.segments:
                slots[segment.start : segment.end] = segment.slot
            self._row_slots = slots
        return self._row_slots

    def mask(self, width: int, device: torch.device) -> torch.Tensor:
        """[rows, max_loras * width]: 1 where a row's own slot's columns are, else 0 (built once per
        forward and width, shared by the layers of that width)."""
        key = (width, device)
        mask = self._masks.get(key)
        if mask is None:
            assert self._batch is not None
            mask = torch.zeros(self._batch.num_rows, self.max_loras, width, device=device)
            for segment in self._batch.segments:
                mask[segment.start : segment.end, segment.slot] = 1.0
            mask = self._masks[key] = mask.view(self._batch.num_rows, self.max_loras * width)
        return mask


class LoRALinear:
    """The stacked adapter weights of one Linear (whose `parts` are the checkpoint modules it fuses)."""

    def __init__(self, linear: Linear, part_rows: Sequence[int], max_loras: int, max_rank: int,
                 context: LoRAContext, device: torch.device) -> None:  # fmt: skip
        self.parts = linear.parts
        self.part_rows = tuple(part_rows)  # output rows of each part, in order
        self.width = width = len(self.parts) * max_rank
        self.a = torch.zeros(max_loras, width, linear.in_features, device=device)
        self.bt = torch.zeros(max_loras, width, linear.out_features, device=device)
        self.widths = [0] * max_loras  # columns slot s uses: parts x its rank (0: no adapter there)
        self.widths_tensor = torch.zeros(max_loras, dtype=torch.int64)  # the same, for the CPU kernel
        self.context = context
        self.kernels = cpu_kernels.load() if device.type == "cpu" else None  # None: the torch paths
        # Every slot side by side (views, no copy): the masked path's two matmuls.
        self.a_all = self.a.view(max_loras * width, linear.in_features)
        self.bt_all = self.bt.view(max_loras * width, linear.out_features)

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Slot `slot` holds `adapter`'s matrices for these parts (zeros where it targets none of them)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.widths[slot] = 0
        self.widths_tensor[slot] = 0
        if adapter is None or not any(part in adapter.weights for part in self.parts):
            return
        rank, row = adapter.rank, 0
        for p, (part, rows) in enumerate(zip(self.parts, self.part_rows, strict=True)):
            if part in adapter.weights:
                a, b = adapter.weights[part]
                self.a[slot, p * rank : (p + 1) * rank].copy_(a)
                self.bt[slot, p * rank : (p + 1) * rank, row : row + rows].copy_((b * adapter.scaling).T)
            row += rows
        self.widths[slot] = len(self.parts) * rank
        self.widths_tensor[slot] = self.widths[slot]

    def add_delta(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out[rows] += (x[rows] @ A^T) @ B^T for each segment of the forward's batch, in place."""
        batch = self.context.batch
        if batch is None:
            return
        if batch.rowwise and self.kernels is not None and x.dtype == out.dtype == torch.float32 and out.is_contiguous():
            self.kernels.lora_bgmv_(out, x.contiguous(), self.a, self.bt, self.context.row_slots(), self.widths_tensor)
            return
        if batch.rowwise and len(batch.segments) > 1:
            h = x.to(self.a.dtype) @ self.a_all.T
            h.mul_(self.context.mask(self.width, h.device))
            out.add_((h @ self.bt_all).to(out.dtype))
            return
        for segment in batch.segments:
            width = self.widths[segment.slot]
            if width == 0:
                continue
            a, bt = self.a[segment.slot, :width], self.bt[segment.slot, :width]
            rows = slice(segment.start, segment.end)
            out[rows].add_(((x[rows].to(a.dtype) @ a.T) @ bt).to(out.dtype))  # a view of out: in place


@dataclass
class LoRAModel:
    """Every LoRALinear of a model, and their shared context."""

    context: LoRAContext
    model: LlamaForCausalLM
    # The model's fused decode layers (one compiled call per decode step, adapter rows included): they
    # run for forwards without adapter rows and for those whose rows are added row-wise (set_batch).
    fused_decode: FusedDecodeLayers | None = None
    layers: list[LoRALinear] = field(default_factory=list)

    def set_batch(self, batch: LoRABatch | None) -> None:
        """The next forward's adapter rows (None: none). The fused decode may run unless the rows are
        too many to add row-wise (its per-row adds are the row-wise path's)."""
        self.context.batch = batch
        self.model.fused_decode = self.fused_decode if batch is None or batch.rowwise else None

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for layer in self.layers:
            layer.set_slot(slot, adapter)


def attach_lora(model: LlamaForCausalLM, max_loras: int, max_rank: int) -> LoRAModel:
    """Give every targetable projection of `model` (one rank, dense attention and MLP) its stacked
    slots, empty; the model's fused decode layers then run only in forwards without adapter rows.
    Raises ValueError for models LoRA is not served on."""
    arch = model.arch
    if arch.moe is not None or arch.mla is not None or model.shard.tp.is_parallel:
        raise ValueError(f"LoRA is served on one rank over dense attention models, not {arch.architecture}"
                         + (" at tensor parallelism" if model.shard.tp.is_parallel else ""))  # fmt: skip
    lora = LoRAModel(LoRAContext(max_loras), model, model.fused_decode)
    device = model.embed_tokens.weight.device
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    stacked: list[tuple[StackedLoRA, StackedLoRA, StackedLoRA, StackedLoRA]] = []
    for layer in model.decoder_layers:
        attention, mlp = layer.self_attn, layer.mlp
        assert isinstance(attention, LlamaAttention) and isinstance(mlp, LlamaMLP)
        layer_loras = []
        for linear, rows in ((attention.qkv_proj, (q, kv, kv)), (attention.o_proj, (arch.hidden_size,)),
                             (mlp.gate_up_proj, (arch.intermediate_size,) * 2), (mlp.down_proj, (arch.hidden_size,))):  # fmt: skip
            lora_linear = LoRALinear(linear, rows, max_loras, max_rank, lora.context, device)
            linear.lora = lora_linear
            lora.layers.append(lora_linear)
            layer_loras.append(StackedLoRA(lora_linear.a, lora_linear.bt, lora_linear.widths_tensor))
        qkv_lora, o_lora, gate_up_lora, down_lora = layer_loras
        stacked.append((qkv_lora, o_lora, gate_up_lora, down_lora))
    if lora.fused_decode is not None:
        context = lora.context
        lora.fused_decode.add_lora(stacked, lambda: context.row_slots() if context.batch is not None else None)
    return lora
