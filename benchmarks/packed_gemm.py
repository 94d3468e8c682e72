"""A prompt's linear layers on the default model: F.linear (MKL's `cblas_sgemm`, which packs the
weight into panels on every call) against MKL's packed GEMM (`kernels/mkl_gemm.py`: the panels made
once per weight), float32 both, over the 30 decoder layers' four matmuls (q/k/v, o, gate/up, down)
with the model's own weights, for prompts of M rows. Each round runs both, alternating which goes
first; the table gives medians of --rounds, and the relative error of the packed result against
float64 next to F.linear's.

    PYTHONPATH=src .venv/bin/python benchmarks/packed_gemm.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from servelm.kernels import mkl_gemm
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint

# The voice / chat prompt sizes of the mixed profile, then a chunk's (512) and the budget's (2,048).
ROWS = (16, 63, 159, 178, 512, 2048)


def decoder_weights() -> list[torch.Tensor]:
    """The default model's decoder matmul weights [N, K] in float32, fused as the model fuses them."""
    checkpoint = load_checkpoint()
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu")
    return [
        linear.weight.detach()
        for layer in model.layers
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


def seconds(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def relative_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    exact = x.double() @ weight.double().T
    return ((got.double() - exact).norm() / exact.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    kernel = mkl_gemm.load()
    if kernel is None:
        raise SystemExit("MKL's packed GEMM is not available here (no MKL in this PyTorch, or SERVELM_KERNELS=torch)")
    weights = decoder_weights()
    packed = [kernel.pack(w) for w in weights]
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(weights)} matmuls a forward")
    print("| rows | F.linear (ms) | packed (ms) | packed / F.linear | rel. error F.linear / packed |")
    print("|---:|---:|---:|---:|---|")
    for rows in ROWS:
        inputs = [torch.randn(rows, w.shape[1], generator=gen) for w in weights]

        def dense(inputs: list[torch.Tensor] = inputs) -> list[torch.Tensor]:
            return [F.linear(x, w) for x, w in zip(inputs, weights)]

        def with_panels(inputs: list[torch.Tensor] = inputs) -> list[torch.Tensor]:
            return [kernel.matmul(x, p) for x, p in zip(inputs, packed)]

        dense(), with_panels()  # warm
        times: dict[str, list[float]] = {"dense": [], "packed": []}
        for round_index in range(args.rounds):
            order = [("dense", dense), ("packed", with_panels)]
            for name, run in order if round_index % 2 == 0 else order[::-1]:
                times[name].append(seconds(run))
        dense_s, packed_s = statistics.median(times["dense"]), statistics.median(times["packed"])
        errors = (relative_error(F.linear(inputs[0], weights[0]), inputs[0], weights[0]),
                  relative_error(kernel.matmul(inputs[0], packed[0]), inputs[0], weights[0]))  # fmt: skip
        print(f"| {rows} | {dense_s * 1e3:.1f} | {packed_s * 1e3:.1f} | {packed_s / dense_s:.2f}x "
              f"| {errors[0]:.1e} / {errors[1]:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
