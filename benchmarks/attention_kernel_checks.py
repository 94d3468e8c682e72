"""The Triton attention backend against the torch reference backend on fresh random inputs of real
sizes (gpu_checks.py's "kernels" section; runs anywhere Triton runs, the interpreter included).

One case is a mixed step over a random pool: decodes with contexts up to `max_context`, prompt
chunks after prefix-cached context and fresh prompts, GQA, shuffled block tables. Both backends
write the step's K/V into their own copy of the pool and attend; the check is the relative error
‖out − ref‖ / ‖ref‖ of the outputs (float32 on both sides: the ieee dot; bf16: looser, METHOD.md's
ranges) and the pools written identically. Decode timings compare the two backends per call.
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import asdict, dataclass

import torch

from servelm.attention.backend import AttentionBackend, CommonAttentionInputs
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.attention.triton_backend import TritonAttentionBackend

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Geometry:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16


GEOMETRIES = (Geometry(32, 8, 64), Geometry(32, 8, 128), Geometry(9, 3, 64))


@dataclass
class KernelCheck:
    geometry: str
    dtype: str
    requests: int
    tokens: int
    relative_error: float
    limit: float
    pools_equal: bool
    passed: bool


@dataclass
class MixedStep:
    common: CommonAttentionInputs
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    pool: torch.Tensor  # [2, blocks, block_size, KVH, D], context already filled


def mixed_step(geo: Geometry, dtype: torch.dtype, device: str, max_context: int, seed: int,
               max_prompt: int = 400) -> MixedStep:  # fmt: skip
    """Six decodes, two chunks after cached context, one fresh prompt (of up to `max_prompt`
    tokens; chunks up to 3/4 of that), over shuffled blocks."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(rng.randint(1, max_context), 1) for _ in range(6)]  # (cached, new)
    shapes += [(rng.randint(16, max_context // 2), rng.randint(17, max(17, max_prompt * 3 // 4))) for _ in range(2)]
    shapes.append((0, rng.randint(min(50, max_prompt), max_prompt)))
    rng.shuffle(shapes)
    bs = geo.block_size
    blocks_per = [(c + n + bs - 1) // bs for c, n in shapes]
    ids = list(range(sum(blocks_per) + 1))
    rng.shuffle(ids)
    tables, cursor = [], 0
    for count in blocks_per:
        tables.append(ids[cursor : cursor + count])
        cursor += count
    width = max(blocks_per)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = []
    for row, (cached, new) in enumerate(shapes):
        positions = torch.arange(cached, cached + new)
        slots.append(table[row, positions // bs].long() * bs + positions % bs)
    common = CommonAttentionInputs.from_lens(
        [n for _, n in shapes], [c + n for c, n in shapes], slot_mapping=torch.cat(slots).to(device),
        block_table=table, block_size=bs, device=device, dtype=dtype,
    )  # fmt: skip
    tokens = common.num_tokens

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype).to(device)

    pool = randn(2, len(ids), bs, geo.kv_heads, geo.head_dim)  # the cached context: random, everywhere
    return MixedStep(common, randn(tokens, geo.heads, geo.head_dim), randn(tokens, geo.kv_heads, geo.head_dim),
                     randn(tokens, geo.kv_heads, geo.head_dim), pool)  # fmt: skip


def _attend(backend: AttentionBackend, step: MixedStep, pool: torch.Tensor) -> torch.Tensor:
    metadata = backend.build_metadata(step.common)
    return backend.forward(step.query, step.key, step.value, pool, metadata, step.query.shape[-1] ** -0.5)


def check_backends(device: str, max_context: int = 4096, seed: int = 0,
                   geometries: tuple[Geometry, ...] = GEOMETRIES, max_prompt: int = 400) -> list[KernelCheck]:  # fmt: skip
    checks = []
    for geo in geometries:
        for dtype in (torch.float32, torch.bfloat16):
            step = mixed_step(geo, dtype, device, max_context, seed, max_prompt)
            ref_pool, pool = step.pool.clone(), step.pool.clone()
            expected = _attend(TorchAttentionBackend(), step, ref_pool).double()
            actual = _attend(TritonAttentionBackend(), step, pool).double()
            error = ((actual - expected).norm() / expected.norm()).item()
            limit = TOLERANCE[dtype]
            equal = torch.equal(pool, ref_pool)
            checks.append(KernelCheck(f"{geo.heads}/{geo.kv_heads} heads x {geo.head_dim}", str(dtype).removeprefix("torch."),
                                      step.common.num_requests, step.common.num_tokens, error, limit, equal,
                                      error <= limit and equal and not actual.isnan().any().item()))  # fmt: skip
    return checks


def decode_timings(device: str, cases: tuple[tuple[int, int], ...] = ((1, 4096), (64, 1024)),
                   iterations: int = 50) -> list[dict]:  # fmt: skip
    """Microseconds per decode attention call (K/V write included), Triton vs torch, bf16, 32/8 x 128."""
    geo, dtype = Geometry(32, 8, 128), torch.bfloat16
    rows = []
    for batch, context in cases:
        bs = geo.block_size
        per = (context + bs - 1) // bs
        table = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
        positions = torch.full((batch,), context - 1)
        slots = (table[torch.arange(batch), positions // bs].long() * bs + positions % bs).to(device)
        common = CommonAttentionInputs.from_lens([1] * batch, [context] * batch, slot_mapping=slots, block_table=table,
                                                 block_size=bs, device=device, dtype=dtype)  # fmt: skip
        gen = torch.Generator().manual_seed(batch)
        pool = torch.randn(2, batch * per, bs, geo.kv_heads, geo.head_dim, generator=gen).to(dtype).to(device)
        q = torch.randn(batch, geo.heads, geo.head_dim, generator=gen).to(dtype).to(device)
        k = torch.randn(batch, geo.kv_heads, geo.head_dim, generator=gen).to(dtype).to(device)
        row: dict = {"batch": batch, "context": context}
        for name, backend in (("torch", TorchAttentionBackend()), ("triton", TritonAttentionBackend())):
            metadata = backend.build_metadata(common)
            call = functools.partial(backend.forward, q, k, k, pool, metadata, 0.088)
            row[f"{name}_us"] = time_us(call, device, iterations)
        kv_bytes = 2 * batch * context * geo.kv_heads * geo.head_dim * 2
        row["triton_gbps"] = kv_bytes / (row["triton_us"] * 1e-6) / 1e9
        rows.append(row)
    return rows


def time_us(call, device: str, iterations: int) -> float:
    """Mean microseconds per call after a warm-up (synchronised on CUDA)."""
    for _ in range(3):
        call()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iterations):
        call()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / iterations * 1e6


def as_dicts(checks: list[KernelCheck]) -> list[dict]:
    return [asdict(c) for c in checks]
