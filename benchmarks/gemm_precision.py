"""Accuracy and speed of a narrower prefill GEMM (--gemm-precision bfloat16) against float32,
on the default model (SmolLM2-135M, its GGUF, CPU) (issue 19, build item 3).

    .venv/bin/python benchmarks/gemm_precision.py                         # the recorded run
    .venv/bin/python benchmarks/gemm_precision.py --prompts 4 --max-tokens 16 --lengths 128

Three measurements per precision, the same inputs for each:

    greedy    the engine (scheduler + runner, prefix caching on) generates --max-tokens greedy tokens
              (ignore_eos) for --prompts chat prompts: the fraction of requests whose tokens equal
              float32's, and the mean number of tokens before the first difference
    logits    each chat prompt followed by float32's greedy output, as one prompt (every row through
              the many-row GEMM), and the same texts joined into one long document: at every
              position max and mean |logit - logit_float32| and whether the argmax agrees
    speed     the engine's prefill of a --lengths prompt of random tokens (max_tokens 1; median of
              --repeats), the step budget chunking it as the server would

The CPU's bfloat16 instructions decide the speed: `lscpu` is printed first.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
from kv_cache_dtype_accuracy import accuracy, chat_prompts, greedy

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import build_engine
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.sampling_params import SamplingParams
from servelm.testing.reference_decode import prompt_logits


def cpu_line() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    narrow = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags.split()]
    return f"{name}; {', '.join(narrow)}"


def teacher_forced(model, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """[positions, vocab]: the logits over each prompt + its output as one prompt, and over all of
    them joined into one document, concatenated."""
    texts = [p + o for p, o in zip(prompts, outputs)]
    document = [t for text in texts for t in text]
    return torch.cat(prompt_logits(model, texts) + prompt_logits(model, [document]))


def prefill_seconds(precision: str, length: int, repeats: int) -> float:
    """The median time for the engine to prefill a `length`-token prompt of random tokens."""
    core = build_engine(EngineConfig.from_flat(gemm_precision=precision)).core
    gen = torch.Generator().manual_seed(length)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats + 1):  # the first warms the kernels and the step cost model
        prompt = torch.randint(100, 10000, (length,), generator=gen).tolist()
        core.add_request(EngineRequest(request_id=f"{length}-{i}", prompt_token_ids=prompt, sampling_params=params))
        started = time.perf_counter()
        while not any(out.finish_reason is not None for out in core.step()):
            pass
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--precisions", default="bfloat16", help="compared with float32")
    parser.add_argument("--lengths", default="128,512,3000", help="prompt lengths timed")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    lengths = [int(n) for n in args.lengths.split(",")]

    print(f"CPU: {cpu_line()}; {torch.get_num_threads()} threads")
    checkpoint = load_checkpoint(None)
    models = {
        p: build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu", gemm_precision=p)
        for p in ["float32", *precisions]
    }
    prompts = chat_prompts(checkpoint.tokenizer, args.prompts)
    reference_tokens = greedy(models["float32"], checkpoint, "auto", prompts, args.max_tokens)
    reference_logits = teacher_forced(models["float32"], prompts, reference_tokens)
    print(f"{len(prompts)} chat prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} greedy tokens each; logits at {reference_logits.shape[0]} positions "
          f"(a document of {reference_logits.shape[0] // 2} tokens among them)")  # fmt: skip

    print("\n| GEMM precision | identical greedy requests | mean tokens to first difference | max abs logit error "
          "| mean abs logit error | top-1 agreement (teacher-forced) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name in precisions:
        tokens = greedy(models[name], checkpoint, "auto", prompts, args.max_tokens)
        a = accuracy(
            reference_tokens, tokens, reference_logits, teacher_forced(models[name], prompts, reference_tokens)
        )
        print(f"| {name} | {a.identical:.1%} ({round(a.identical * len(prompts))}/{len(prompts)}) "
              f"| {a.tokens_to_divergence:.1f} / {args.max_tokens} | {a.max_logit_error:.3f} "
              f"| {a.mean_logit_error:.4f} | {a.top1_agreement:.2%} |")  # fmt: skip
    del models

    print(f"\nPrefill through the engine (median of {args.repeats}):")
    print("\n| GEMM precision | " + " | ".join(f"{n} tokens (ms)" for n in lengths) + " | vs float32 |")
    print("|---|" + "---:|" * (len(lengths) + 1))
    reference: list[float] = []
    for name in ["float32", *precisions]:
        seconds = [prefill_seconds(name, n, args.repeats) for n in lengths]
        reference = reference or seconds
        ratios = " / ".join(f"{s / r:.2f}x" for s, r in zip(seconds, reference))
        print(f"| {name} | " + " | ".join(f"{s * 1000:.0f}" for s in seconds) + f" | {ratios} |")


if __name__ == "__main__":
    main()
