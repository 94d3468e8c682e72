"""Single-stream decode step time of the default model (SmolLM2-135M, GGUF blocks, float32 on CPU)
under tensor parallelism (issue 15): TP=2 (two processes, one thread each; its small collectives
through shared memory, and all over gloo) against one rank with one thread and one rank with two
threads.

    .venv/bin/python benchmarks/tp_decode_step.py [--prompt-tokens 32] [--steps 64] [--repeats 3]

Each configuration runs in its own spawned process(es) (servelm.testing.ranks, gloo): one request,
its prompt prefilled, then --steps decode steps of one token over a paged KV pool
(servelm.testing.batch_decode). A step is the forward, the full logits (all-gathered under TP) and
the argmax, timed on rank 0; the figure is the median step, best of --repeats runs. Run it on a quiet
machine: the configurations use 1-2 cores each.

Measured on the 2-core build VM (issue 15): 1 rank 1 thread 33-34 ms, 1 rank 2 threads 26 ms,
TP=2 70-74 ms. TP=2 loses because of gloo: a step issues 62 collectives (2 all-reduces per layer,
the embedding's, the logits' all-gather) and a gloo all-reduce of one [1, 576] row costs 0.24-0.4 ms
here (0.8 ms seen inside the step, waits for the slower rank included: at 9 heads / 3 KV heads rank 0
holds twice rank 1's attention); the halved matmuls save ~15 ms, the collectives cost ~50 ms.

With the small collectives through shared memory (servelm.parallel.shm_collectives; 12 us a [1, 576]
all-reduce against gloo's 265 us, benchmarks/collectives_latency.py), same VM, quiet, 2 repeats:
1 rank 1 thread 33.9 ms, 1 rank 2 threads 22.9 ms, TP=2 23.1 ms (1.47x one thread), TP=2 gloo only 77.7 ms.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from servelm.default_model import default_model_path
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.models.gguf_loader import gguf_hf_config, load_gguf_weights, open_gguf
from servelm.parallel.groups import ParallelGroups, ParallelLayout
from servelm.testing.batch_decode import batch_greedy_decode
from servelm.testing.ranks import run_ranks


def decode_steps(groups: ParallelGroups, prompt: list[int], steps: int, repeats: int) -> list[float]:
    """On one rank: the median decode step (seconds) of each repeat; the tokens must agree across repeats."""
    reader = open_gguf(default_model_path())
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    model = build_model(arch, load_gguf_weights(reader, arch, "default"), torch.float32, "cpu", tp=groups.tp)
    medians = []
    for _ in range(repeats):
        run = batch_greedy_decode(model, [prompt], steps + 1, block_size=16)
        medians.append(statistics.median(run.step_seconds[1:]))  # step 0 is the prefill
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompt = torch.randint(100, 10000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    configurations = [("1 rank, 1 thread", 1, 1, True), ("1 rank, 2 threads", 1, 2, True),
                      ("TP=2, 1 thread each", 2, 1, True), ("TP=2, gloo only", 2, 1, False)]  # fmt: skip
    rows = []
    for label, tp, threads, shared_memory in configurations:
        ranks = run_ranks(decode_steps, ParallelLayout(tp), (prompt, args.steps, args.repeats), threads=threads,
                          timeout_s=600, shared_memory=shared_memory)  # fmt: skip
        rows.append((label, min(ranks[0]) * 1e3))
    base = rows[0][1]
    print(f"default model, single stream, prompt {args.prompt_tokens} tokens, median of {args.steps} decode steps")
    print(f"{'configuration':<22} {'step ms':>8} {'vs 1 thread':>12}")
    for label, ms in rows:
        print(f"{label:<22} {ms:8.2f} {base / ms:11.2f}x")


if __name__ == "__main__":
    main()
