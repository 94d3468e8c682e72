"""Fused (Triton) against unfused (torch) RMSNorm + residual add and rotary embedding, per call.

    fused_op_microbench("cuda")   -> dict (rows per op, shape and token count; see its docstring)
    python benchmarks/fused_ops_bench.py [--device cuda] [--dtype bfloat16]   # prints a markdown table

On CUDA each call is timed two ways: `eager_us`, back-to-back launches from Python (what an
uncaptured forward pays: launch overhead included), and `graph_us`, the same calls replayed from a
CUDA graph (GPU time only, what a captured decode step pays). `bytes` is what the fused kernel must
move (read inputs, write outputs) and `fused_gbps` the bandwidth it reached. On CPU the Triton side
runs under the interpreter (TRITON_INTERPRET=1 before the first kernel import), so its times mean
nothing there; the CPU run exists to check that the function works.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from servelm.models.fused_ops import TORCH_OPS, NormRotaryOps, triton_ops
from servelm.models.rotary import RotaryEmbedding


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int  # q heads + kv heads: the columns the model rotates in one call
    head_dim: int
    theta: float


SHAPES = (
    Shape("smollm2-135m", 576, 9 + 3, 64, 100000.0),  # the default model
    Shape("llama-8b", 4096, 32 + 8, 128, 500000.0),
)
TOKEN_COUNTS = (1, 32, 256, 4096)  # decode batches up to a prefill chunk


def fused_op_microbench(
    device: str | torch.device = "cuda",
    *,
    dtype: torch.dtype = torch.bfloat16,
    shapes: Sequence[Shape] = SHAPES,
    token_counts: Iterable[int] = TOKEN_COUNTS,
    iterations: int = 100,
) -> dict:
    """Times torch vs Triton for `add_rms_norm` and `rotate` on `device`.

    Returns {"device", "dtype", "rows": [{"op", "shape", "tokens", "torch_eager_us", "triton_eager_us",
    "torch_graph_us", "triton_graph_us" (None off CUDA or where capture fails), "bytes", "fused_gbps",
    "max_abs_diff" (fused vs unfused outputs)}]}. Each time is the median per call.
    """
    device = torch.device(device)
    fused = triton_ops()
    rows = []
    for shape in shapes:
        for tokens in token_counts:
            for op, make in (("add_rms_norm", _norm_case), ("rotate", _rotary_case)):
                unfused_call, fused_call, bytes_moved, diff = make(shape, tokens, dtype, device, fused)
                row = {"op": op, "shape": shape.name, "tokens": tokens, "bytes": bytes_moved, "max_abs_diff": diff}
                for name, call in (("torch", unfused_call), ("triton", fused_call)):
                    row[f"{name}_eager_us"] = _eager_us(call, device, iterations)
                    row[f"{name}_graph_us"] = _graph_us(call, iterations) if device.type == "cuda" else None
                best = row["triton_graph_us"] or row["triton_eager_us"]
                row["fused_gbps"] = bytes_moved / (best * 1e-6) / 1e9
                rows.append(row)
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "rows": rows}


Case = tuple[Callable[[], object], Callable[[], object], int, float]


def _norm_case(shape: Shape, tokens: int, dtype: torch.dtype, device: torch.device, fused: NormRotaryOps) -> Case:
    gen = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, shape.hidden, generator=gen).to(dtype).to(device) for _ in range(2))
    weight = torch.randn(shape.hidden, generator=gen).to(dtype).to(device)
    want, _ = TORCH_OPS.add_rms_norm(x, residual, weight, 1e-5)
    got, _ = fused.add_rms_norm(x, residual, weight, 1e-5)
    diff = (got.float() - want.float()).abs().max().item() if tokens else 0.0
    bytes_moved = 4 * x.numel() * x.element_size()  # read x and residual, write out and the sum
    return (lambda: TORCH_OPS.add_rms_norm(x, residual, weight, 1e-5),
            lambda: fused.add_rms_norm(x, residual, weight, 1e-5), bytes_moved, diff)  # fmt: skip


def _rotary_case(shape: Shape, tokens: int, dtype: torch.dtype, device: torch.device, fused: NormRotaryOps) -> Case:
    gen = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(shape.head_dim, shape.theta, None).to(device)
    cos, sin = rotary.cos_sin(torch.randint(0, 8192, (tokens,), generator=gen).to(device), dtype)
    qk = torch.randn(tokens, shape.heads, shape.head_dim, generator=gen).to(dtype).to(device)
    want = TORCH_OPS.rotate(qk, cos, sin)
    got = fused.rotate(qk.clone(), cos, sin)
    diff = (got.float() - want.float()).abs().max().item() if tokens else 0.0
    # In place, the fused kernel rotates the same tensor over and over: the same bytes each time.
    bytes_moved = 2 * qk.numel() * qk.element_size() + 2 * cos.numel() * cos.element_size()
    return lambda: TORCH_OPS.rotate(qk, cos, sin), lambda: fused.rotate(qk, cos, sin), bytes_moved, diff


def _eager_us(call: Callable[[], object], device: torch.device, iterations: int) -> float:
    call()  # compiles / warms the caches
    samples = []
    for _ in range(5):
        _sync(device)
        started = time.perf_counter()
        for _ in range(iterations):
            call()
        _sync(device)
        samples.append((time.perf_counter() - started) / iterations * 1e6)
    return statistics.median(samples)


def _graph_us(call: Callable[[], object], iterations: int) -> float | None:
    """GPU time per call: `iterations` calls captured in one CUDA graph, replayed."""
    try:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
            call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iterations):
                call()
    except RuntimeError:
        return None
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iterations)
    return statistics.median(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown(result: dict) -> str:
    """The result as a markdown table (times in µs per call; speedups torch / triton)."""

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if not a or not b else f"{a / b:.1f}x"

    lines = [
        f"fused vs unfused ops on {result['device']}, {result['dtype']} (µs per call)",
        "",
        "| op | shape | tokens | torch eager | triton eager | speedup | torch graph | triton graph | speedup "
        "| fused GB/s | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['tokens']} | {cell(r['torch_eager_us'])} | {cell(r['triton_eager_us'])} "
            f"| {ratio(r['torch_eager_us'], r['triton_eager_us'])} | {cell(r['torch_graph_us'])} "
            f"| {cell(r['triton_graph_us'])} | {ratio(r['torch_graph_us'], r['triton_graph_us'])} "
            f"| {r['fused_gbps']:.0f} | {r['max_abs_diff']:.3g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iterations", type=int, default=100)
    args = parser.parse_args()
    result = fused_op_microbench(args.device, dtype=getattr(torch, args.dtype), iterations=args.iterations)
    print(markdown(result))


if __name__ == "__main__":
    main()
