"""Quantized KV pools (--kv-cache-dtype int8 / fp8): round-trip error bounds, slot writes and reads,
the CPU paged kernel's int8 variant against the dequantized float32 pool, and the whole backend
over a quantized pool against the same backend over the dequantized values."""

from __future__ import annotations

import pytest
import torch

from servelm.attention import torch_backend
from servelm.attention.backend import CommonAttentionInputs
from servelm.attention.kv_storage import (
    QuantizedKV,
    block_tensors,
    dequantize,
    gather_kv,
    gather_kv_blocks,
    quantize,
    write_kv,
)
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.kernels import cpu as cpu_kernels

kernels = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(kernels is None, reason="no C compiler: the kernel cannot be built here")
QUANTIZED = [torch.int8, torch.float8_e4m3fn]


def _values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values spread over magnitudes (heads of very different scale, some exact zeros)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape[:-1], generator=gen)).unsqueeze(-1)
    x[0, 0] = 0.0  # an all-zero head
    return x


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_round_trip_error_is_within_the_bound(dtype):
    x = _values((257, 3, 64), seed=1)  # [N, KVH, D]
    codes, scales = quantize(x, dtype)
    assert codes.dtype == dtype and scales.shape == (257, 3) and scales.dtype == torch.float32
    error = (dequantize(codes, scales, torch.float32) - x).abs()
    step = scales.unsqueeze(-1)
    if dtype == torch.int8:
        bound = step / 2 * (1 + 1e-5)  # half a code step, plus float32 rounding of x / scale
    else:  # e4m3: 3 mantissa bits (half an ulp is 1/16 relative), subnormals step 2^-9 of the scale
        bound = torch.maximum(x.abs() / 16, step * 2**-10) * (1 + 1e-5)
    assert bool((error <= bound).all()), f"worst excess {(error - bound).max().item()}"
    assert bool((dequantize(codes, scales, torch.float32)[0, 0] == 0).all())  # zeros stay zeros
    assert codes.view(torch.uint8).unique().numel() > 64  # the codes use their range


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_written_slots_read_back_dequantized_and_others_stay_untouched(dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 2, 8
    pool = QuantizedKV(
        torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype),
        torch.zeros(2, num_blocks, block_size, kv_heads),
    )
    key, value = _values((5, kv_heads, head_dim), seed=2), _values((5, kv_heads, head_dim), seed=3)
    slots = torch.tensor([21, 3, 4, 9, 0])
    write_kv(pool, key, value, slots)
    for which, x in enumerate((key, value)):
        codes, scales = quantize(x, dtype)
        assert torch.equal(gather_kv(pool, which, slots, torch.float32), dequantize(codes, scales, torch.float32))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert bool((pool.scales.view(2, -1, kv_heads)[:, untouched] == 0).all())
    # A [R, L] slot grid reads a [R, L, KVH, D] batch, as the decode and chunk paths ask for it.
    grid = slots[:4].view(2, 2)
    assert gather_kv(pool, 1, grid, torch.bfloat16).shape == (2, 2, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, *QUANTIZED])
@pytest.mark.parametrize("planes", [2, 1])  # K and V; one latent plane read as both
def test_a_requests_blocks_read_what_its_positions_slots_read(dtype, planes):
    """A chunk's context is read a block at a time (gather_kv_blocks): the same values, in the
    same order, as reading its positions' slots one by one, a partly filled last block cut."""
    num_blocks, block_size, kv_heads, head_dim = 7, 4, 2, 8
    shape = (planes, num_blocks, block_size, kv_heads, head_dim)
    if dtype == torch.float32:
        pool = _values(shape, seed=4)
    else:
        pool = QuantizedKV(torch.zeros(shape, dtype=dtype), torch.zeros(shape[:-1]))
        everything = torch.arange(num_blocks * block_size)
        write_kv(pool, _values((everything.numel(), kv_heads, head_dim), seed=5),
                 _values((everything.numel(), kv_heads, head_dim), seed=6), everything)  # fmt: skip
    blocks = torch.tensor([5, 0, 3])
    num_tokens = 10  # two full blocks and half of the third
    positions = torch.arange(num_tokens)
    slots = blocks[positions // block_size] * block_size + positions % block_size
    for which in (0, 1):
        got = gather_kv_blocks(pool, which, blocks, num_tokens, torch.float32)
        assert torch.equal(got, gather_kv(pool, which, slots, torch.float32))


def test_quantized_pool_refuses_mismatched_tensors():
    with pytest.raises(ValueError, match="data must be one of"):
        QuantizedKV(torch.zeros(2, 3, 4, 1, 8), torch.zeros(2, 3, 4, 1))
    with pytest.raises(ValueError, match=r"scales must be float32 of shape \(2, 3, 4, 1\)"):
        QuantizedKV(torch.zeros(2, 3, 4, 1, 8, dtype=torch.int8), torch.zeros(2, 3, 4, 8))


def test_block_tensors_list_every_block_indexed_tensor_in_layer_order():
    plain = [torch.zeros(2, 5, 4, 1, 8) for _ in range(2)]
    assert block_tensors(plain) == plain
    quantized = [QuantizedKV(torch.zeros(2, 5, 4, 1, 8, dtype=torch.int8), torch.zeros(2, 5, 4, 1)) for _ in range(2)]
    tensors = block_tensors(quantized)
    expected = [quantized[0].data, quantized[0].scales, quantized[1].data, quantized[1].scales]
    assert len(tensors) == 4 and all(t is e for t, e in zip(tensors, expected))
    assert all(t.shape[1] == 5 for t in tensors)  # dim 1 is the block id


def _quantized_pool(num_blocks, block_size, kv_heads, head_dim, dtype, seed):
    """A pool filled with quantized random K/V, and the float32 values it stands for."""
    codes, scales = [], []
    for which in range(2):
        c, s = quantize(_values((num_blocks * block_size, kv_heads, head_dim), seed + which), dtype)
        codes.append(c.view(num_blocks, block_size, kv_heads, head_dim))
        scales.append(s.view(num_blocks, block_size, kv_heads))
    pool = QuantizedKV(torch.stack(codes), torch.stack(scales))
    return pool, dequantize(pool.data, pool.scales, torch.float32)


@needs_kernel
@pytest.mark.parametrize(
    "batch,heads,kv_heads,head_dim,block_size",
    [(1, 9, 3, 64, 16), (5, 4, 2, 16, 4), (3, 6, 1, 12, 5), (20, 8, 8, 32, 16)],
)
def test_int8_kernel_matches_the_float32_kernel_on_the_dequantized_pool(batch, heads, kv_heads, head_dim, block_size):
    """AVX2 and scalar loops (head_dim 12), batches below and above the thread count, scattered tables."""
    assert kernels is not None
    gen = torch.Generator().manual_seed(batch)
    num_blocks = 40
    pool, values = _quantized_pool(num_blocks, block_size, kv_heads, head_dim, torch.int8, seed=batch)
    lens = torch.randint(1, 6 * block_size, (batch,), generator=gen, dtype=torch.int32)
    tables = torch.randint(0, num_blocks, (batch, 6), generator=gen, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    max_len = int(lens.max())
    fast = kernels.decode_attention(
        q, pool.data[0], pool.data[1], tables, lens, max_len, 0.3, (pool.scales[0], pool.scales[1])
    )
    reference = kernels.decode_attention(q, values[0], values[1], tables, lens, max_len, 0.3)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_int8_kernel_refuses_scales_of_the_wrong_shape():
    assert kernels is not None
    pool, _ = _quantized_pool(4, 4, 2, 8, torch.int8, seed=0)
    args = (torch.zeros(1, 2, 8), pool.data[0], pool.data[1], torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1, 1.0)  # fmt: skip
    with pytest.raises(cpu_kernels.KernelArgumentError, match="v_scales: expected shape"):
        kernels.decode_attention(*args, (pool.scales[0], pool.scales[1, :, :2].contiguous()))
    with pytest.raises(cpu_kernels.KernelArgumentError, match="k_pool: expected dtype torch.int8"):
        kernels.decode_attention(args[0], pool.data[0].float(), *args[2:], (pool.scales[0], pool.scales[1]))


def _mixed_step(block_size: int = 4):
    """Three decodes, a short query after context (verification-like), a fresh prompt and a long
    chunk after context: every read path of the backend, over one scattered block table."""
    query_lens, seq_lens = [1, 3, 1, 7, 20, 1], [9, 14, 1, 7, 31, 22]
    widths = [(s + block_size - 1) // block_size for s in seq_lens]
    ids = torch.randperm(sum(widths) + 2, generator=torch.Generator().manual_seed(4))
    table = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    used = 0
    for i, w in enumerate(widths):
        table[i, :w] = ids[used : used + w].to(torch.int32)
        used += w
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        slots += [int(table[i, p // block_size]) * block_size + p % block_size for p in range(s - q, s)]
    common = CommonAttentionInputs.from_lens(
        query_lens, seq_lens, slot_mapping=torch.tensor(slots), block_table=table, block_size=block_size,
        kv_dtype=torch.int8,
    )  # fmt: skip
    return common, int(ids.numel())


@pytest.mark.parametrize("dtype,use_kernel", [(torch.int8, True), (torch.int8, False), (torch.float8_e4m3fn, False)])
def test_backend_over_a_quantized_pool_matches_the_backend_over_its_dequantized_values(monkeypatch, dtype, use_kernel):
    """Same step, same inputs: a quantized pool (kernel or gather path) against a float32 pool holding
    exactly the dequantized values, given the step's K/V already dequantized."""
    if use_kernel and kernels is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    common, num_blocks = _mixed_step()
    common = CommonAttentionInputs.from_lens(
        common.query_lens, common.seq_lens, slot_mapping=common.slot_mapping, block_table=common.block_table,
        block_size=common.block_size, kv_dtype=dtype,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    num_tokens = common.num_tokens
    q = torch.randn(num_tokens, 6, 16, generator=gen)
    k, v = _values((num_tokens, 2, 16), seed=10), _values((num_tokens, 2, 16), seed=11)
    pool, values = _quantized_pool(num_blocks, common.block_size, 2, 16, dtype, seed=12)
    # The float32 reference stores exactly what the quantized pool will hold after the write.
    k_codes, k_scales = quantize(k, dtype)
    v_codes, v_scales = quantize(v, dtype)
    k_ref, v_ref = dequantize(k_codes, k_scales, torch.float32), dequantize(v_codes, v_scales, torch.float32)
    if not use_kernel:
        monkeypatch.setattr(torch_backend, "_paged_kernel", lambda device, dtype: None)
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(common)
    expected_plan = torch_backend.KernelDecodes if use_kernel and dtype == torch.int8 else torch_backend.GatherDecodes
    assert isinstance(metadata.decodes, expected_plan)
    out = backend.forward(q, k, v, pool, metadata, 0.25)
    reference_common = CommonAttentionInputs.from_lens(
        common.query_lens, common.seq_lens, slot_mapping=common.slot_mapping, block_table=common.block_table,
        block_size=common.block_size,
    )  # fmt: skip
    reference = backend.forward(q, k_ref, v_ref, values, backend.build_metadata(reference_common), 0.25)
    # Every read sees the stored values, the fresh prompt's (request 3) own K/V included.
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    fresh = slice(int(common.query_start_loc[3]), int(common.query_start_loc[4]))
    unquantized = backend.forward(q[fresh], k[fresh], v[fresh], None, backend.build_metadata(
        CommonAttentionInputs.for_prompts([fresh.stop - fresh.start])), 0.25)  # fmt: skip
    assert not torch.allclose(out[fresh], unquantized, rtol=1e-6, atol=1e-6)
