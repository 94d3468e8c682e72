"""The attention backend interface, and the step's common inputs every backend builds from.

A step's batch is the tokens of many requests laid end to end, in scheduler order:

    tokens:           | r0 chunk (5) | r1 decode (1) | r2 chunk (3) |
    query_start_loc:  0              5               6              9
    seq_lens:         5              12              7      (cached + new tokens per request)

Request i's new tokens sit at positions [seq_lens[i] - query_lens[i], seq_lens[i]) of its
sequence; they attend to every earlier position of the same request and to nothing
of the others. With a paged KV pool the K/V of earlier positions live in blocks:

    block_table[i]:  | 7 | 2 | 9 |          (block_size 4)
    position:          0123 4567 89..
    slot = block_table[i, pos // block_size] * block_size + pos % block_size
         e.g. pos 5 → block 2, offset 1 → slot 9

`slot_mapping[t]` is that slot for new token t (where its K/V are written).

Per step the runner fills one `CommonAttentionInputs`; the model's backend turns it
into its own typed metadata once (`AttentionBackend.build_metadata`), and every
layer's `forward` only reads that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from servelm.attention.kv_storage import LayerKVCache


@dataclass(frozen=True)
class CommonAttentionInputs:
    """What every backend needs to know about one step's flattened batch (R requests, T tokens).

    Small per-request arrays stay on the CPU, where backends plan from them; the one
    per-token array the layers index with (`slot_mapping`) is already on `device`.
    """

    query_start_loc: torch.Tensor  # [R + 1] int32, CPU: offset of request i's tokens in the batch
    query_lens: torch.Tensor  # [R] int32, CPU: new tokens of request i this step
    seq_lens: torch.Tensor  # [R] int32, CPU: request i's context after this step (cached + new)
    num_decode_requests: int  # requests with exactly one new token (in place, not reordered)
    num_prefill_requests: int  # the others: prompt chunks, with or without cached context
    max_query_len: int
    max_seq_len: int
    # Paged KV; both None when the forward runs without a KV pool (`for_prompts`):
    slot_mapping: torch.Tensor | None  # [T] long, on `device`: pool slot of each new token
    block_table: torch.Tensor | None  # [R, max_blocks] int32, CPU: block ids, row i = request i
    block_size: int  # tokens per block (0 without a pool)
    device: torch.device  # where the model runs
    dtype: torch.dtype  # the model's compute dtype (queries, and K/V as attended)
    # What the KV pool stores: `dtype`, or int8 / float8_e4m3fn codes with scales (kv_storage.py).
    kv_dtype: torch.dtype

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def has_kv_pool(self) -> bool:
        return self.block_table is not None

    @classmethod
    def from_lens(
        cls,
        query_lens: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        *,
        slot_mapping: torch.Tensor | None,
        block_table: torch.Tensor | None,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,  # None: the pool stores `dtype`
    ) -> CommonAttentionInputs:
        """The inputs of a batch whose request i runs `query_lens[i]` new tokens ending at `seq_lens[i]`.

        Raises ValueError when the arrays disagree (lengths, a query longer than its
        context, a slot per token, a table row per request, a block_size for the pool).
        """
        q_lens = torch.as_tensor(query_lens, dtype=torch.int32).cpu()
        s_lens = torch.as_tensor(seq_lens, dtype=torch.int32).cpu()
        if q_lens.dim() != 1 or q_lens.shape != s_lens.shape or q_lens.numel() == 0:
            raise ValueError(
                f"query_lens {tuple(q_lens.shape)} and seq_lens {tuple(s_lens.shape)} must be equal, non-empty 1-D"
            )
        if bool((q_lens < 1).any()) or bool((s_lens < q_lens).any()):
            raise ValueError(
                f"every query_len must be >= 1 and <= its seq_len; got {q_lens.tolist()} / {s_lens.tolist()}"
            )
        if (slot_mapping is None) != (block_table is None):
            raise ValueError("slot_mapping and block_table go together: give both (a KV pool) or neither")
        query_start_loc = torch.zeros(q_lens.numel() + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if slot_mapping is not None and block_table is not None:
            if slot_mapping.shape != (num_tokens,):
                raise ValueError(
                    f"slot_mapping has shape {tuple(slot_mapping.shape)}, want ({num_tokens},): one slot per new token"
                )
            if block_table.dim() != 2 or block_table.shape[0] != q_lens.numel():
                raise ValueError(
                    f"block_table has shape {tuple(block_table.shape)}, want ({q_lens.numel()}, max_blocks)"
                )
            if block_size < 1:
                raise ValueError(f"block_size must be >= 1 with a KV pool, got {block_size}")
        num_decodes = int((q_lens == 1).sum())
        return cls(
            query_start_loc=query_start_loc,
            query_lens=q_lens,
            seq_lens=s_lens,
            num_decode_requests=num_decodes,
            num_prefill_requests=q_lens.numel() - num_decodes,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(s_lens.max()),
            slot_mapping=slot_mapping,
            block_table=block_table,
            block_size=block_size,
            device=torch.device(device),
            dtype=dtype,
            kv_dtype=dtype if kv_dtype is None else kv_dtype,
        )

    @classmethod
    def for_prompts(cls, prompt_lens: Sequence[int], device: torch.device | str = "cpu") -> CommonAttentionInputs:
        """Each request is a whole prompt with nothing cached, and there is no KV pool
        (a forward for parity checks and prompt logits)."""
        return cls.from_lens(prompt_lens, prompt_lens, slot_mapping=None, block_table=None, block_size=0, device=device)


def slots_of(block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slots of `positions` of the requests in `block_table` rows `rows` (one formula for all).

    block_table: [R, max_blocks] int; rows and positions: equal (or broadcastable) shapes,
    long. Returns long slots of the broadcast shape:
        slot = block_table[row, pos // block_size] * block_size + pos % block_size
    """
    block_ids = block_table[rows, torch.div(positions, block_size, rounding_mode="floor")].long()
    return block_ids * block_size + positions % block_size


class AttentionMetadata:
    """Base of every backend's per-step metadata (e.g. `TorchAttentionMetadata`).

    The model passes it, unopened, from the runner to its layers' `backend.forward`;
    only the backend that built it reads its fields. Immutable for the step.
    """


class AttentionBackend(Protocol):
    """Computes causal attention for a flattened batch and maintains the paged KV pool.

    `build_metadata` is called once per step by whoever runs the forward (the model
    runner, in the engine core process; the reference decoder in tests), before the
    forward. It is pure: it builds index tensors from `common` and mutates nothing, so
    calling it twice gives equal metadata. Every layer then calls `forward` with that
    same metadata.

    `forward` is called by the model's attention layers inside the forward, in the same
    process. It writes the new tokens' K/V into `kv_cache` at the metadata's slots (when
    a cache is given; quantized when the pool stores codes) before reading; it changes nothing else, so calling it twice with
    the same inputs writes the same values twice.
    """

    name: str  # "torch", "triton", ...: what --attention-backend calls it

    def build_metadata(self, common: CommonAttentionInputs) -> AttentionMetadata: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: LayerKVCache | None,  # [2, num_blocks, block_size, num_kv_heads, head_dim] (kv_storage.py)
        metadata: AttentionMetadata,  # what this backend's build_metadata returned this step
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


@dataclass(frozen=True)
class DecodeGraphBuffers:
    """Persistent inputs of a pure-decode step (one new token per request), sized for the largest
    batch a captured graph serves; every tensor lives on the model's device.

    A CUDA graph replays the kernels it captured on the same memory, so a captured decode step
    reads its inputs from these buffers and the graph runner (worker/cuda_graphs.py) refills
    rows [0, batch) before each replay. Rows past the real batch are padding: they decode token 0
    at position 0 of a request whose only block is `padding_block_id` (a pool block the scheduler
    never hands out), with seq_len 1 and slot `padding_block_id * block_size`, so every kernel runs
    unchanged on them and their K/V writes land where nobody reads.
    """

    input_ids: torch.Tensor  # [max_batch] long
    positions: torch.Tensor  # [max_batch] long
    slot_mapping: torch.Tensor  # [max_batch] long: pool slot of each row's new token
    seq_lens: torch.Tensor  # [max_batch] int32: context after this step (cached + 1)
    block_table: torch.Tensor  # [max_batch, max_blocks_per_seq] int32
    block_size: int
    padding_block_id: int

    @property
    def max_batch(self) -> int:
        return self.input_ids.shape[0]


class DecodeGraphBackend(Protocol):
    """A backend whose pure-decode metadata can be built from `DecodeGraphBuffers` alone.

    `build_decode_metadata(buffers, batch, ...)` returns metadata for rows [0, batch).

    - `graph_capturable` True: the metadata's tensors are views of the buffers (never copies,
      never host values read from them), so one metadata object per batch size stays valid for
      every later refill, and its decode `forward` neither synchronises with the host nor
      allocates anything whose shape depends on the buffers' values (what CUDA graph capture
      needs). The Triton backend.
    - False: the metadata may read the buffers' values when built, so the graph runner builds it
      again after every refill and runs the step eagerly. The torch reference; this is how CPU
      tests check the graph runner's bookkeeping (buckets, padding, buffer reuse) on the real model.
    """

    graph_capturable: bool

    def build_decode_metadata(
        self,
        buffers: DecodeGraphBuffers,
        batch: int,  # rows [0, batch) of the buffers, padding rows included
        *,
        dtype: torch.dtype,  # the model's compute dtype
        kv_dtype: torch.dtype,  # what the pool stores
    ) -> AttentionMetadata: ...


def supports_decode_graphs(backend: object) -> bool:
    """Whether `backend` implements DecodeGraphBackend (a graph runner may drive its decodes)."""
    return callable(getattr(backend, "build_decode_metadata", None)) and hasattr(backend, "graph_capturable")


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _BACKENDS[name] = factory


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
