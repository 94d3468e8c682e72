"""SERVELM_KERNELS=torch turns the compiled kernels off, and the pure-torch paths it leaves give the
kernels' results: paged decode attention through the attention backend, and a GGUF block Linear."""

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
from servelm.models.gguf_blocks import BlockType
from servelm.models.linear_methods import BlockLinearMethod
from servelm.models.llama import Linear
from servelm.testing.random_blocks import random_block_weight


def test_torch_switch_turns_the_kernels_off_and_says_so_once(kernel_env, caplog):
    caplog.set_level(logging.INFO, logger=cpu.__name__)
    kernel_env(envs.KERNELS, "torch")
    assert cpu.load() is None
    assert cpu.load() is None
    said = [r for r in caplog.records if r.name == cpu.__name__]
    assert len(said) == 1 and "pure-torch" in said[0].getMessage()


def test_an_unknown_switch_value_names_the_valid_ones(kernel_env):
    kernel_env(envs.KERNELS, "fast")
    with pytest.raises(ValueError, match="SERVELM_KERNELS='fast'.*valid values: auto, torch, unfused"):
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
    """A Linear with the block method over Q4_1 blocks, and a bias."""
    linear = Linear(cols, rows, True, ("unused",), BlockLinearMethod(BlockType.Q4_1))
    with torch.no_grad():
        linear.method.load_rows(linear, random_block_weight(BlockType.Q4_1, rows, cols, gen), 0)
        linear.bias.copy_(torch.randn(rows, generator=gen))
    return linear


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_block_linear_is_the_same_with_the_kernel_and_with_pure_torch(kernel_env, compiled_kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    linear = _q4_1_linear(48, 256, gen)
    x = torch.randn(rows, 256, generator=gen)
    # [rows, 48]: the same float32 weights (dequantised from the blocks), multiplied by torch
    reference = F.linear(x, linear.weight, linear.bias)

    with_kernel = linear(x)  # SERVELM_KERNELS=auto (the compiled_kernels fixture): the block kernel
    kernel_product = compiled_kernels.block_gemm(x, linear.blocks, BlockType.Q4_1.value)
    assert torch.equal(with_kernel, kernel_product + linear.bias)  # it did go through the kernel
    torch.testing.assert_close(with_kernel, reference, rtol=1e-5, atol=1e-5)

    kernel_env(envs.KERNELS, "torch")
    assert cpu.load() is None
    with_torch = linear(x)  # the method's float32 path
    torch.testing.assert_close(with_kernel, with_torch, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_torch, reference, rtol=0, atol=0)
