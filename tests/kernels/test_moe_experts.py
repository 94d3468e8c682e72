"""The compiled routed-experts kernel (csrc/moe.c) against a float64 reference, in the plain-C and the
AVX2 builds: each (token, expert) pair adds its weighted SwiGLU expert output to its token's row, for
experts with no pair, one or several, and sizes with SIMD and task tails; the result does not depend
on the thread count; bad pairs and offsets are refused before anything is written."""

from __future__ import annotations

import itertools

import pytest
import torch

from servelm.kernels import cpu
from servelm.kernels.arguments import KernelArgumentError

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler: the kernels cannot be built here")


def _case(tokens: int, experts: int, top_k: int, hidden: int, width: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(experts, 2 * width, hidden, generator=generator) * 0.2
    down = torch.randn(experts, hidden, width, generator=generator) * 0.2
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])  # [T, k]
    weights = torch.rand(tokens, top_k, generator=generator)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()
    offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
    return x, gate_up, down, order // top_k, weights.reshape(-1)[order].contiguous(), offsets


def _reference(x, gate_up, down, pair_token, pair_weight, offsets) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    width = down.shape[2]
    for e in range(down.shape[0]):
        for p in range(int(offsets[e]), int(offsets[e + 1])):
            t = int(pair_token[p])
            h = gate_up[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:width]) * h[width:]
            out[t] += float(pair_weight[p]) * (down[e].double() @ act)
    return out


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "width"),
                         [(1, 8, 2, 64, 32), (5, 16, 2, 72, 40), (16, 64, 2, 136, 24), (3, 4, 4, 40, 17)])  # fmt: skip
def test_each_pair_adds_its_weighted_expert_output(kernels, tokens, experts, top_k, hidden, width) -> None:
    x, gate_up, down, pair_token, pair_weight, offsets = _case(tokens, experts, top_k, hidden, width, seed=tokens)
    out = torch.zeros_like(x)
    kernels.moe_experts_(out, x, gate_up, down, pair_token, pair_weight, offsets)
    want = _reference(x, gate_up, down, pair_token, pair_weight, offsets)
    assert torch.allclose(out.double(), want, rtol=1e-4, atol=1e-4), (out.double() - want).abs().max()


def test_the_result_does_not_depend_on_the_thread_count(kernels) -> None:
    case = _case(16, 64, 2, 136, 48, seed=9)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out = torch.zeros_like(case[0])
            kernels.moe_experts_(out, *case)
            results.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def test_bad_pairs_and_offsets_are_refused_before_any_write(kernels) -> None:
    x, gate_up, down, pair_token, pair_weight, offsets = _case(4, 8, 2, 32, 16, seed=1)
    out = torch.zeros_like(x)
    bad_token = pair_token.clone()
    bad_token[3] = 4
    with pytest.raises(KernelArgumentError, match="pair 3"):
        kernels.moe_experts_(out, x, gate_up, down, bad_token, pair_weight, offsets)
    falling = offsets.clone()
    falling[2] = falling[1] - 1 if falling[1] > 0 else -1
    with pytest.raises(KernelArgumentError):
        kernels.moe_experts_(out, x, gate_up, down, pair_token, pair_weight, falling)
    with pytest.raises(KernelArgumentError, match="do not fit"):
        kernels.moe_experts_(out, x, gate_up, down[:, :, :8].contiguous(), pair_token, pair_weight, offsets)
    assert not out.any()
