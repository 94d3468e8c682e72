"""The decode graph runner: pure-decode steps (one new token per request) as replayed CUDA graphs.

A decode step's forward is the same few hundred small kernels every time; launching them from
Python costs more than running them at small batches. A CUDA graph records the launches once and
replays them in one call, on the same memory: so the step's inputs live in persistent buffers
(`DecodeGraphBuffers`, attention/backend.py) refilled before each replay, and one graph is captured
per batch-size bucket, the batch padded up to its bucket:

    capture sizes:  1  2  4  8  16  24  32 ...  (vLLM's: every 8 up to 256, then every 16)
    a batch of 11 → bucket 16:
        rows  0..10   the step's requests, in scheduler order
        rows 11..15   padding: token 0 at position 0, seq_len 1, block table row all padding_block_id,
                      slot padding_block_id * block_size (its K/V land in a pool block nobody reads)
        rows 16..     left as they are: the bucket-16 graph never reads them

The graph covers the model's forward up to its final hidden states ([bucket, hidden]); the model
runner takes rows [0, batch) of them to the LM head and the sampler, outside the graph. A bucket's
graph is captured the first time a batch needs it (warm-up runs first, then the capture, timed),
all of them in one shared memory pool: only one replays at a time, and its output is read before
the next replay.

Where no graph can be captured (the device is not CUDA, or the backend's metadata reads the
buffers' values: `graph_capturable` False) the same runner, when asked to, does the same
bookkeeping (buckets, padding, refills) and runs the padded batch eagerly, building the backend's
metadata again after every refill. That is how CPU tests check it on the real model.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from servelm.attention.backend import (
    AttentionMetadata,
    CommonAttentionInputs,
    DecodeGraphBackend,
    DecodeGraphBuffers,
    supports_decode_graphs,
)
from servelm.attention.kv_storage import LayerKVCache
from servelm.config import CudaGraphConfig
from servelm.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Largest default bucket (vLLM's default cap): beyond, a step's own launch overhead is amortised.
DEFAULT_MAX_CAPTURE_SIZE = 512
# Forwards before a capture: the first calls compile Triton kernels and set up cuBLAS workspaces,
# which must not happen inside a capture.
NUM_WARMUP_RUNS = 2


class DecodeGraphMode(enum.Enum):
    OFF = "off"  # every step eager, through the model runner's own per-step inputs
    EAGER_BUFFERS = "eager_buffers"  # pure decodes through the persistent buffers, run eagerly
    CAPTURE = "capture"  # pure decodes replay one captured CUDA graph per bucket


def decode_graph_mode(config: CudaGraphConfig, device: torch.device, backend: object) -> DecodeGraphMode:
    """How pure-decode steps run: graphs when the device is CUDA and the backend is graph-capturable
    (unless --enforce-eager); the eager buffer path where forced; eager otherwise. Raises ValueError
    when forced on a backend that does not implement DecodeGraphBackend."""
    if config.enforce_eager:
        return DecodeGraphMode.OFF
    supported = supports_decode_graphs(backend)
    if supported and device.type == "cuda" and getattr(backend, "graph_capturable", False):
        return DecodeGraphMode.CAPTURE
    if config.force_decode_buffers:
        if not supported:
            raise ValueError(
                f"force_decode_buffers: the attention backend {type(backend).__name__} has no build_decode_metadata"
            )
        return DecodeGraphMode.EAGER_BUFFERS
    return DecodeGraphMode.OFF


def capture_sizes(max_size: int) -> tuple[int, ...]:
    """The buckets up to `max_size`: 1, 2, 4, every 8 up to 256, then every 16 (vLLM's default
    cudagraph_capture_sizes), and `max_size` itself, so that every batch up to it has a bucket."""
    if max_size < 1:
        raise ValueError(f"the largest capture size must be >= 1, got {max_size}")
    sizes = {1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16), max_size}
    return tuple(sorted(s for s in sizes if s <= max_size))


def resolve_capture_sizes(config: CudaGraphConfig, max_num_seqs: int) -> tuple[int, ...]:
    """Buckets for an engine running at most `max_num_seqs` requests (no decode batch is larger)."""
    largest = config.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE
    return capture_sizes(min(largest, max_num_seqs))


def allocate_buffers(
    max_batch: int, max_blocks_per_seq: int, block_size: int, padding_block_id: int, device: torch.device
) -> DecodeGraphBuffers:
    """Buffers for batches of up to `max_batch` rows, every row padding (see the module)."""
    return DecodeGraphBuffers(
        input_ids=torch.zeros(max_batch, dtype=torch.long, device=device),
        positions=torch.zeros(max_batch, dtype=torch.long, device=device),
        slot_mapping=torch.full((max_batch,), padding_block_id * block_size, dtype=torch.long, device=device),
        seq_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
        block_table=torch.full((max_batch, max_blocks_per_seq), padding_block_id, dtype=torch.int32, device=device),
        block_size=block_size,
        padding_block_id=padding_block_id,
    )


@dataclass(frozen=True)
class DecodeGraphStats:
    """What the graph runner has done so far (an engine may expose it)."""

    capturing: bool  # graphs are captured and replayed (False: the buffers run eagerly)
    capture_sizes: tuple[int, ...]  # the buckets, ascending
    captured: tuple[int, ...]  # buckets whose graph exists, ascending
    capture_seconds: float  # wall time of every capture so far, its warm-up runs included
    steps: dict[int, int]  # bucket → steps run through it


@dataclass(frozen=True)
class _CapturedStep:
    graph: torch.cuda.CUDAGraph
    metadata: AttentionMetadata  # views of the buffers: what the captured kernels read
    hidden: torch.Tensor  # [bucket, hidden], in the graph's pool: each replay writes it


class DecodeGraphRunner:
    """Runs pure-decode steps of up to `max_batch` requests through persistent buffers (module doc).

    Called by the model runner, in the engine core process, once per pure-decode step that `fits`;
    not thread-safe (one step at a time). `forward` refills the buffers, so a previous step's
    returned hidden states may be overwritten by the next call.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[LayerKVCache],  # per layer, with the padding block (kv_cache.allocate_kv_caches)
        mode: DecodeGraphMode,  # CAPTURE or EAGER_BUFFERS
        sizes: Sequence[int],  # the buckets (capture_sizes)
        max_blocks_per_seq: int,  # block table columns of the longest request
        block_size: int,
        padding_block_id: int,  # the pool block the scheduler never hands out
    ) -> None:
        backend = model.decoder_layers[0].self_attn.backend
        if mode is DecodeGraphMode.OFF or not supports_decode_graphs(backend):
            raise ValueError(f"a decode graph runner needs mode CAPTURE or EAGER_BUFFERS and a DecodeGraphBackend, "
                             f"got {mode} and {type(backend).__name__}")  # fmt: skip
        self.model = model
        self.backend = cast(DecodeGraphBackend, backend)  # supports_decode_graphs checked it
        self.kv_caches = list(kv_caches)
        self.capturing = mode is DecodeGraphMode.CAPTURE
        self.sizes = tuple(sorted(set(sizes)))
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.kv_dtype = self.kv_caches[0].dtype
        self.buffers = allocate_buffers(self.sizes[-1], max_blocks_per_seq, block_size, padding_block_id, self.device)
        self._graphs: dict[int, _CapturedStep] = {}
        self._reused_metadata: dict[int, AttentionMetadata] = {}  # eager runs of a capturable backend
        self._pool = torch.cuda.graph_pool_handle() if self.capturing else None
        self._capture_seconds = 0.0
        self._steps: Counter[int] = Counter()
        logger.info("decode graphs: %s, batch buckets %s (each captured on first use)" if self.capturing
                    else "decode graph buffers without graphs (%s): batch buckets %s, run eagerly",
                    mode.value, ",".join(map(str, self.sizes)))  # fmt: skip

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding `batch` rows; None above the largest (the step runs eagerly)."""
        return next((size for size in self.sizes if size >= batch), None)

    def fits(self, batch: int) -> bool:
        return 1 <= batch <= self.sizes[-1]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B] long, on device: each request's one new token
        positions: torch.Tensor,  # [B] long, on device
        common: CommonAttentionInputs,  # the step's inputs (every query_len 1), with a KV pool
    ) -> torch.Tensor:  # [B, hidden]: rows [0, B) of the padded batch's final hidden states
        batch = input_ids.shape[0]
        bucket = self.bucket_for(batch)
        if bucket is None or common.max_query_len != 1 or common.num_requests != batch:
            raise ValueError(
                f"the decode graph runner takes 1..{self.sizes[-1]} requests of one new token each, "
                f"got {common.num_requests} requests, {batch} tokens (longest query {common.max_query_len})"
            )
        self._fill(input_ids, positions, common, bucket)
        self._steps[bucket] += 1
        if not self.capturing:
            return self._run(bucket, self._eager_metadata(bucket))[:batch]
        captured = self._graphs.get(bucket)
        if captured is None:
            captured = self._graphs[bucket] = self._capture(bucket)
        captured.graph.replay()
        return captured.hidden[:batch]

    def stats(self) -> DecodeGraphStats:
        return DecodeGraphStats(self.capturing, self.sizes, tuple(sorted(self._graphs)), self._capture_seconds,
                                dict(self._steps))  # fmt: skip

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionInputs,
              bucket: int) -> None:  # fmt: skip
        """Rows [0, batch) from the step, rows [batch, bucket) padding; device copies and fills only."""
        assert common.slot_mapping is not None and common.block_table is not None  # a KV pool (forward's caller)
        buffers, batch = self.buffers, input_ids.shape[0]
        buffers.input_ids[:batch].copy_(input_ids)
        buffers.positions[:batch].copy_(positions)
        buffers.slot_mapping[:batch].copy_(common.slot_mapping)
        buffers.seq_lens[:batch].copy_(common.seq_lens, non_blocking=True)
        # Every entry a row does not own holds the padding block: a kernel reading past a row's
        # length (none should) would find nobody's K/V.
        buffers.block_table[:bucket].fill_(buffers.padding_block_id)
        buffers.block_table[:batch, : common.block_table.shape[1]].copy_(common.block_table, non_blocking=True)
        if bucket > batch:
            buffers.input_ids[batch:bucket].zero_()
            buffers.positions[batch:bucket].zero_()
            buffers.slot_mapping[batch:bucket].fill_(buffers.padding_block_id * buffers.block_size)
            buffers.seq_lens[batch:bucket].fill_(1)

    def _eager_metadata(self, bucket: int) -> AttentionMetadata:
        """Metadata for an eager run through the buffers. A capturable backend's is built once per
        bucket and reused across refills, exactly as a captured graph reuses it (so CPU runs check
        the contract replays rely on); any other backend's is built again from this refill."""
        if not self.backend.graph_capturable:
            return self.backend.build_decode_metadata(self.buffers, bucket, dtype=self.dtype, kv_dtype=self.kv_dtype)
        metadata = self._reused_metadata.get(bucket)
        if metadata is None:
            metadata = self._reused_metadata[bucket] = self.backend.build_decode_metadata(
                self.buffers, bucket, dtype=self.dtype, kv_dtype=self.kv_dtype
            )
        return metadata

    def _run(self, bucket: int, metadata: AttentionMetadata) -> torch.Tensor:  # [bucket, hidden]
        buffers = self.buffers
        return self.model(buffers.input_ids[:bucket], buffers.positions[:bucket], metadata, self.kv_caches)

    def _capture(self, bucket: int) -> _CapturedStep:
        """Warm up, then capture bucket `bucket`'s forward from the buffers as they are now (this step's
        rows: the warm-up runs compute the step and write its K/V, the same values the replay writes)."""
        started = time.perf_counter()
        metadata = self.backend.build_decode_metadata(self.buffers, bucket, dtype=self.dtype, kv_dtype=self.kv_dtype)
        side = torch.cuda.Stream(self.device)  # warm-up on a side stream, as torch's CUDA graph notes ask
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_RUNS):
                self._run(bucket, metadata)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._run(bucket, metadata)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self._capture_seconds += seconds
        logger.info("decode graph for batch %d captured in %.3f s (%d of %d buckets, %.2f s of capture in all)",
                    bucket, seconds, len(self._graphs) + 1, len(self.sizes), self._capture_seconds)  # fmt: skip
        return _CapturedStep(graph, metadata, hidden)
