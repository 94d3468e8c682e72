"""Bad arguments to the compiled kernels raise KernelArgumentError naming the argument, before any
pointer reaches C: wrong dtypes, a device other than the CPU, non-contiguous views, shapes that
disagree with each other, and lengths or block ids that would read outside the pool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from servelm.kernels.arguments import KernelArgumentError

Args = dict[str, Any]


def _decode_args() -> Args:
    """A valid decode batch: 2 requests, 6 heads over 2 KV heads, head_dim 16, 8 blocks of 4."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 8, 4, 2, 16, generator=gen)
    return {
        "query": torch.randn(2, 6, 16, generator=gen),
        "k_pool": pool[0],
        "v_pool": pool[1],
        "block_tables": torch.tensor([[3, 1, 0], [7, 0, 0]], dtype=torch.int32),
        "seq_lens": torch.tensor([10, 2], dtype=torch.int32),
        "max_len": 10,
        "scale": 0.25,
    }


def _set(name: str, make: Callable[[Args], Any]) -> Callable[[Args], Args]:
    return lambda args: {**args, name: make(args)}


DECODE_CASES = {
    "float64 query": ("query", _set("query", lambda a: a["query"].double())),
    "int64 block tables": ("block_tables", _set("block_tables", lambda a: a["block_tables"].long())),
    "float16 pool": ("k_pool", _set("k_pool", lambda a: a["k_pool"].half())),
    "query on another device": ("query", _set("query", lambda a: a["query"].to("meta"))),
    "non-contiguous query": ("query", _set("query", lambda a: a["query"].transpose(0, 1).contiguous().transpose(0, 1))),
    "non-contiguous v_pool": ("v_pool", _set("v_pool", lambda a: torch.randn(8, 2, 4, 16).transpose(1, 2))),
    "a list for seq_lens": ("seq_lens", _set("seq_lens", lambda a: [10, 2])),
    "block table rows != batch": ("block_tables", _set("block_tables", lambda a: a["block_tables"][:1].contiguous())),
    "seq_lens length != batch": ("seq_lens", _set("seq_lens", lambda a: torch.tensor([10], dtype=torch.int32))),
    "heads not a multiple of kv heads": ("k_pool", _set("query", lambda a: torch.randn(2, 5, 16))),
    "pool head_dim != query's": ("k_pool", _set("query", lambda a: torch.randn(2, 6, 8))),
    "v_pool shape != k_pool's": ("v_pool", _set("v_pool", lambda a: torch.randn(8, 4, 1, 16))),
    "seq_len past max_len": ("request 0", _set("max_len", lambda a: 9)),
    "seq_len past the table": ("request 1", _set("seq_lens", lambda a: torch.tensor([10, 13], dtype=torch.int32))),
    "seq_len 0": ("request 1", _set("seq_lens", lambda a: torch.tensor([10, 0], dtype=torch.int32))),
    "block id past the pool": ("request 0", _set("block_tables", lambda a: torch.tensor([[3, 8, 0], [7, 0, 0]], dtype=torch.int32))),
    "negative block id": ("request 1", _set("block_tables", lambda a: torch.tensor([[3, 1, 0], [-1, 0, 0]], dtype=torch.int32))),
    "max_len a bool": ("max_len", _set("max_len", lambda a: True)),
}


def test_the_valid_decode_batch_runs(compiled_kernels):
    out = compiled_kernels.decode_attention(**_decode_args())
    assert out.shape == (2, 6, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_a_bad_decode_argument_is_named(compiled_kernels, case):
    named, spoil = DECODE_CASES[case]
    with pytest.raises(KernelArgumentError, match=named):
        compiled_kernels.decode_attention(**spoil(_decode_args()))


def test_padding_past_a_seq_len_is_never_checked_nor_read(compiled_kernels):
    """Table entries beyond the blocks a seq_len reaches are padding: any value there is fine."""
    args = _decode_args()
    padded = {**args, "block_tables": torch.tensor([[3, 1, 0], [7, -5, 99]], dtype=torch.int32)}
    torch.testing.assert_close(compiled_kernels.decode_attention(**padded), compiled_kernels.decode_attention(**args))


def _matmul_args() -> Args:
    """A valid block matmul: 3 rows of 64 inputs against 5 outputs stored as Q4_1 (ggml type 3)."""
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (5, 2, 20), dtype=torch.uint8, generator=gen)
    blocks[:, :, 0:4] = torch.rand(5, 2, 2, generator=gen).half().view(torch.uint8)  # d, m: small halves
    return {"x": torch.randn(3, 64, generator=gen), "blocks": blocks, "block_type": 3}


MATMUL_CASES = {
    "float64 x": ("x", _set("x", lambda a: a["x"].double())),
    "int8 blocks": ("blocks", _set("blocks", lambda a: a["blocks"].view(torch.int8))),
    "non-contiguous blocks": ("blocks", _set("blocks", lambda a: a["blocks"].transpose(0, 1))),
    "blocks in 2 dimensions": ("blocks", _set("blocks", lambda a: a["blocks"].reshape(5, 40))),
    "bytes per block not the type's": ("blocks", _set("block_type", lambda a: 8)),
    "unknown block type": ("block_type", _set("block_type", lambda a: 12)),
    "blocks K != x's K": ("x", _set("x", lambda a: torch.randn(3, 96))),
    "x with 3 dimensions": ("x", _set("x", lambda a: a["x"].unsqueeze(0))),
}


def test_the_valid_matmul_matches_its_definition(compiled_kernels):
    args = _matmul_args()
    halves = args["blocks"][:, :, 0:4].contiguous().view(torch.float16).float()  # [5, 2, 2]: d, m
    packed = args["blocks"][:, :, 4:]
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # [5, 2, 32]
    weight = (halves[:, :, :1] * codes + halves[:, :, 1:]).reshape(5, 64)
    torch.testing.assert_close(compiled_kernels.block_gemm(**args), args["x"] @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(MATMUL_CASES))
def test_a_bad_matmul_argument_is_named(compiled_kernels, case):
    named, spoil = MATMUL_CASES[case]
    with pytest.raises(KernelArgumentError, match=named):
        compiled_kernels.block_gemm(**spoil(_matmul_args()))
