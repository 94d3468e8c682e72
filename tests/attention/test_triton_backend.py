"""The Triton backend against the torch reference backend: the same CommonAttentionInputs over
several steps writing into one pool, the captured-decode metadata across buffer refills, and the
real engine's greedy tokens. Kernels run under Triton's interpreter on CPU (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

from servelm.attention.backend import CommonAttentionInputs, DecodeGraphBuffers, supports_decode_graphs
from servelm.attention.kv_storage import LayerKVCache, QuantizedKV
from servelm.attention.selection import resolve_backend_name
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.attention.triton_backend import TritonAttentionBackend
from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import build_engine
from servelm.sampling_params import SamplingParams
from servelm.worker.model_runner import attention_backend_of

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)",
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 9, 3, 16, 12, 24


def _pool(kv_dtype: torch.dtype) -> LayerKVCache:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if kv_dtype == torch.int8:
        return QuantizedKV(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:-1]))
    return torch.zeros(shape, dtype=kv_dtype)


def _same_pool(a: LayerKVCache, b: LayerKVCache) -> bool:
    if isinstance(a, QuantizedKV) and isinstance(b, QuantizedKV):
        return torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return torch.equal(a, b)


# Three requests over shuffled blocks; r2 starts with r1's first block (a prefix-cache hit on its
# 12 tokens). Each step lists (request, new tokens) in scheduler order: decodes sit between
# chunks, a chunk follows cached context, r2 runs a 3-token query (speculative verification).
TABLES = {0: [17, 3, 9, 21, 5], 1: [8, 14, 1], 2: [8, 11, 0, 19]}
STEPS = [
    [(0, 25), (1, 20)],
    [(1, 1), (0, 16), (2, 14)],  # r2: positions 12..25 after the hit
    [(0, 1), (2, 3), (1, 1)],
    [(2, 1), (1, 1), (0, 1)],
]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_mixed_steps_match_the_torch_backend(kv_dtype):
    g = torch.Generator().manual_seed(11)
    torch_pool, triton_pool = _pool(kv_dtype), _pool(kv_dtype)
    reference, backend = TorchAttentionBackend(), TritonAttentionBackend()
    computed = {0: 0, 1: 0, 2: BLOCK_SIZE}
    for step in STEPS:
        query_lens = [n for _, n in step]
        seq_lens = [computed[r] + n for r, n in step]
        width = max(len(TABLES[r]) for r, _ in step)
        table = torch.tensor([TABLES[r] + [0] * (width - len(TABLES[r])) for r, _ in step], dtype=torch.int32)
        positions = [torch.arange(computed[r], computed[r] + n) for r, n in step]
        slots = torch.cat(
            [table[i, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE for i, p in enumerate(positions)]
        )
        common = CommonAttentionInputs.from_lens(
            query_lens, seq_lens, slot_mapping=slots, block_table=table, block_size=BLOCK_SIZE, kv_dtype=kv_dtype
        )
        num_tokens = sum(query_lens)
        q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g)
        k, v = (
            torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g),
        )
        expected = reference.forward(q, k, v, torch_pool, reference.build_metadata(common), 0.25)
        actual = backend.forward(q, k, v, triton_pool, backend.build_metadata(common), 0.25)
        assert (actual - expected).abs().max().item() < 1e-5
        assert _same_pool(triton_pool, torch_pool)
        for r, n in step:
            computed[r] += n


def test_forward_without_a_pool_attends_each_prompt_to_itself():
    g = torch.Generator().manual_seed(12)
    common = CommonAttentionInputs.for_prompts([7, 1, 20])
    q, k, v = (
        torch.randn(28, HEADS, HEAD_DIM, generator=g),
        torch.randn(28, KV_HEADS, HEAD_DIM, generator=g),
        torch.randn(28, KV_HEADS, HEAD_DIM, generator=g),
    )
    reference, backend = TorchAttentionBackend(), TritonAttentionBackend()
    expected = reference.forward(q, k, v, None, reference.build_metadata(common), 0.3)
    actual = backend.forward(q, k, v, None, backend.build_metadata(common), 0.3)
    assert (actual - expected).abs().max().item() < 1e-5


def test_unsupported_pools_and_missing_context_are_refused():
    backend = TritonAttentionBackend()
    table = torch.zeros(1, 1, dtype=torch.int32)
    common = CommonAttentionInputs.from_lens([1], [3], slot_mapping=torch.zeros(1, dtype=torch.long),
                                             block_table=table, block_size=4, kv_dtype=torch.float64)  # fmt: skip
    with pytest.raises(ValueError, match="does not support a KV pool of torch.float64"):
        backend.build_metadata(common)
    no_pool = CommonAttentionInputs.from_lens([2], [5], slot_mapping=None, block_table=None, block_size=0)
    with pytest.raises(ValueError, match="needs a KV pool"):
        backend.build_metadata(no_pool)


def _fill(buffers: DecodeGraphBuffers, seq_lens: list[int], tables: list[list[int]]) -> None:
    """Rows of real decodes, then padding rows (DecodeGraphBuffers' contract) up to max_batch."""
    bs, pad = buffers.block_size, buffers.padding_block_id
    buffers.block_table.fill_(pad)
    buffers.seq_lens.fill_(1)
    buffers.slot_mapping.fill_(pad * bs)
    for i, (seq_len, table) in enumerate(zip(seq_lens, tables)):
        buffers.block_table[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        buffers.seq_lens[i] = seq_len
        position = seq_len - 1
        buffers.slot_mapping[i] = table[position // bs] * bs + position % bs


def test_decode_graph_metadata_is_views_that_follow_refills():
    """One metadata object per batch size: refilling the buffers changes its answer, never it."""
    g = torch.Generator().manual_seed(13)
    max_batch, width, padding_block = 6, 8, NUM_BLOCKS - 1
    buffers = DecodeGraphBuffers(
        input_ids=torch.zeros(max_batch, dtype=torch.long), positions=torch.zeros(max_batch, dtype=torch.long),
        slot_mapping=torch.zeros(max_batch, dtype=torch.long), seq_lens=torch.ones(max_batch, dtype=torch.int32),
        block_table=torch.zeros(max_batch, width, dtype=torch.int32), block_size=BLOCK_SIZE,
        padding_block_id=padding_block,
    )  # fmt: skip
    # Many multiprocessors: the table's 96 positions afford no split, so this covers the plain path;
    # the refills below keep one metadata for both fills.
    backend = TritonAttentionBackend(multiprocessors=64)
    assert supports_decode_graphs(backend) and backend.graph_capturable
    metadata = backend.build_decode_metadata(buffers, 4, dtype=torch.float32, kv_dtype=torch.float32)
    assert metadata.decodes is not None and metadata.slot_mapping is not None
    assert metadata.decodes.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()
    assert metadata.decodes.block_table.data_ptr() == buffers.block_table.data_ptr()
    assert metadata.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
    pool = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    reference = TorchAttentionBackend()
    fills = [
        ([30, 1, 77], [[4, 9, 2], [6], [0, 3, 5, 7, 10, 12, 13]]),
        ([13, 96, 50, 2], [[1, 8], [2, 4, 6, 8, 9, 11, 14, 15], [3, 16, 17, 18, 19], [20]]),
    ]
    for seq_lens, tables in fills:
        _fill(buffers, seq_lens, tables)
        q = torch.randn(4, HEADS, HEAD_DIM, generator=g)
        k, v = torch.randn(4, KV_HEADS, HEAD_DIM, generator=g), torch.randn(4, KV_HEADS, HEAD_DIM, generator=g)
        expected_pool = pool.clone()
        real = len(seq_lens)
        common = CommonAttentionInputs.from_lens([1] * real, seq_lens, slot_mapping=buffers.slot_mapping[:real].clone(),
                                                 block_table=buffers.block_table[:real].clone(), block_size=BLOCK_SIZE)  # fmt: skip
        expected = reference.forward(
            q[:real], k[:real], v[:real], expected_pool, reference.build_metadata(common), 0.25
        )
        actual = backend.forward(q, k, v, pool, metadata, 0.25)
        assert (actual[:real] - expected).abs().max().item() < 1e-5
        not_padding = torch.arange(NUM_BLOCKS) != padding_block
        assert torch.equal(pool[:, not_padding], expected_pool[:, not_padding])  # padding rows wrote only there


def test_decode_graph_metadata_splits_long_contexts():
    """A table wide enough to afford split-K (and many multiprocessors to fill): the split path,
    with rows shorter than a split (empty splits), through the same views."""
    g = torch.Generator().manual_seed(14)
    width, max_batch = 48, 2  # 576 positions: 2 splits of >= 256 keys
    buffers = DecodeGraphBuffers(
        input_ids=torch.zeros(max_batch, dtype=torch.long), positions=torch.zeros(max_batch, dtype=torch.long),
        slot_mapping=torch.zeros(max_batch, dtype=torch.long), seq_lens=torch.ones(max_batch, dtype=torch.int32),
        block_table=torch.zeros(max_batch, width, dtype=torch.int32), block_size=BLOCK_SIZE, padding_block_id=0,
    )  # fmt: skip
    num_blocks = 60
    pool = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    tables = [torch.randperm(num_blocks - 1, generator=g)[:width].add(1).tolist(), [7, 8]]
    _fill(buffers, [300, 20], tables)
    backend = TritonAttentionBackend(multiprocessors=64)
    metadata = backend.build_decode_metadata(buffers, 2, dtype=torch.float32, kv_dtype=torch.float32)
    q = torch.randn(2, HEADS, HEAD_DIM, generator=g)
    k, v = torch.randn(2, KV_HEADS, HEAD_DIM, generator=g), torch.randn(2, KV_HEADS, HEAD_DIM, generator=g)
    common = CommonAttentionInputs.from_lens([1, 1], [300, 20], slot_mapping=buffers.slot_mapping.clone(),
                                             block_table=buffers.block_table.clone(), block_size=BLOCK_SIZE)  # fmt: skip
    reference = TorchAttentionBackend()
    expected = reference.forward(q, k, v, pool.clone(), reference.build_metadata(common), 0.25)
    actual = backend.forward(q, k, v, pool, metadata, 0.25)
    assert (actual - expected).abs().max().item() < 1e-5


# -- selection ---------------------------------------------------------------------------------


def test_auto_resolves_by_device(monkeypatch):
    monkeypatch.delenv("SERVELM_KERNELS", raising=False)
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"  # triton imports here
    monkeypatch.setenv("SERVELM_KERNELS", "torch")
    assert resolve_backend_name("auto", torch.device("cuda")) == "torch"
    assert resolve_backend_name("torch", torch.device("cuda")) == "torch"


def test_explicit_triton_on_cpu_needs_the_interpreter(monkeypatch):
    assert resolve_backend_name("triton", torch.device("cpu")) == "triton"  # TRITON_INTERPRET=1 here
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend_name("triton", torch.device("cpu"))


# -- the engine --------------------------------------------------------------------------------


def _generate(tiny_dir, attention_backend: str, prompts: list[list[int]]):
    """Greedy tokens of `prompts` (one arriving per step) through a small-budget engine."""
    config = EngineConfig.from_flat(
        model=str(tiny_dir), device="cpu", attention_backend=attention_backend, num_blocks=40, block_size=16,
        max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=True,
    )  # fmt: skip
    built = build_engine(config)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    for step in range(200):
        if step < len(prompts):
            params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
            built.core.add_request(
                EngineRequest(request_id=str(step), prompt_token_ids=prompts[step], sampling_params=params)
            )
        for output in built.core.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished.add(output.request_id)
        if len(finished) == len(prompts):
            break
    return built, tokens


def test_engine_greedy_tokens_equal_the_torch_backend(tiny_dir):
    """Chunked prefill (32-token budget), prefix hits (a shared 40-token prefix) and batching."""
    g = torch.Generator().manual_seed(15)
    shared = torch.randint(0, 1000, (40,), generator=g).tolist()
    prompts = [shared + [5, 6, 7], torch.randint(0, 1000, (21,), generator=g).tolist(), shared + [9], [3, 1]]
    triton_engine, triton_tokens = _generate(tiny_dir, "triton", prompts)
    assert isinstance(attention_backend_of(triton_engine.core.runner.model), TritonAttentionBackend)
    assert triton_engine.core.stats().prefix_hits > 0
    _, torch_tokens = _generate(tiny_dir, "torch", prompts)
    assert triton_tokens == torch_tokens
    assert all(len(t) == 5 for t in triton_tokens.values())
