"""SERVELM_KERNELS=torch turns the compiled kernels off, and the pure-torch paths it leaves give the
kernels' results: paged decode attention through the attention backend, and an int8 block Linear."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F

from servelm import envs
from servelm.attention.backend import CommonAttentionInputs
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.kernels import cpu
from servelm.models.int8_blocks import Int8BlockWeight
from servelm.models.linear_methods import Int8BlockLinearMethod
from servelm.models.llama import Linear


def test_torch_switch_turns_the_kernels_off_and_says_so_once(kernel_env, caplog):
    caplog.set_level(logging.INFO, logger=cpu.__name__)
    kernel_env(envs.KERNELS, "torch")
    assert cpu.load() is None
    assert cpu.load() is None
    said = [r for r in caplog.records if r.name == cpu.__name__]
    assert len(said) == 1 and "pure-torch" in said[0].getMessage()


def test_an_unknown_switch_value_names_the_valid_ones(kernel_env):
    kernel_env(envs.KERNELS, "fast")
    with pytest.raises(ValueError, match="SERVELM_KERNELS='fast'.*valid values: auto, torch"):
        cpu.load()


def _paged_decode_batch(seed: int):
    """Decodes of 5 requests (one new token each) over K/V scattered through a pool."""
    heads, kv_heads, head_dim, block_size = 6, 2, 16, 4
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, 40) for _ in range(5)]
    ids = list(range(64))
    rng.shuffle(ids)  # blocks scattered through the pool, as after churn
    tables, used = [], 0
    for n in seq_lens:
        count = (n + block_size - 1) // block_size
        tables.append(ids[used : used + count])
        used += count
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, seq_lens)]
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, 64, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(5, heads, head_dim, generator=gen)
    k = torch.randn(5, kv_heads, head_dim, generator=gen)
    v = torch.randn(5, kv_heads, head_dim, generator=gen)

    width = max(len(t) for t in tables)
    common = CommonAttentionInputs.from_lens(
        [1] * 5, seq_lens, slot_mapping=torch.tensor(slots),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=block_size,
    )  # fmt: skip
    return q, k, v, pool, common


def test_decode_attention_is_the_same_with_the_kernel_and_with_pure_torch(kernel_env, compiled_kernels):
    q, k, v, pool, common = _paged_decode_batch(seed=11)
    backend = TorchAttentionBackend()
    pool_kernel, pool_torch = pool.clone(), pool.clone()
    # The backend picks the decode kernel when it builds a step's metadata: build it under each switch.
    with_kernel = backend.forward(q, k, v, pool_kernel, backend.build_metadata(common), 0.25)
    kernel_env(envs.KERNELS, "torch")
    with_torch = backend.forward(q, k, v, pool_torch, backend.build_metadata(common), 0.25)
    torch.testing.assert_close(with_kernel, with_torch, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool_kernel, pool_torch)  # both wrote the new K/V at the same slots


def _q4_1_linear(rows: int, cols: int, gen: torch.Generator) -> Linear:
    """A Linear with the int8 block method over Q4_1 codes (per 32 inputs: d and m in fp16, q in 0..15),
    as GGUF files hold them, and a bias."""
    w = torch.randn(rows, cols, generator=gen).reshape(rows, -1, 32)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    codes = ((w - m) / torch.where(d == 0, 1, d)).round().clamp(0, 15).to(torch.int8).reshape(rows, cols)
    weight = Int8BlockWeight(codes, d.reshape(rows, -1), m.reshape(rows, -1))
    linear = Linear(cols, rows, True, ("unused",), Int8BlockLinearMethod(with_mins=True))
    with torch.no_grad():
        linear.method.load_rows(linear, weight, 0)
        linear.bias.copy_(torch.randn(rows, generator=gen))
    return linear


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_linear_is_the_same_with_the_kernel_and_with_pure_torch(kernel_env, compiled_kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    linear = _q4_1_linear(48, 256, gen)
    x = torch.randn(rows, 256, generator=gen)
    # [rows, 48]: the same float32 weights (dequantised from the codes), multiplied by torch
    reference = F.linear(x, linear.weight, linear.bias)

    with_kernel = linear(x)  # SERVELM_KERNELS=auto (the compiled_kernels fixture): the int8 kernel
    kernel_product = compiled_kernels.qgemm_small(x, linear.codes, linear.scales, linear.mins)
    assert torch.equal(with_kernel, kernel_product + linear.bias)  # it did go through the kernel
    torch.testing.assert_close(with_kernel, reference, rtol=1e-5, atol=1e-5)

    kernel_env(envs.KERNELS, "torch")
    assert cpu.load() is None
    with_torch = linear(x)  # the method's float32 path
    torch.testing.assert_close(with_kernel, with_torch, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_torch, reference, rtol=0, atol=0)
