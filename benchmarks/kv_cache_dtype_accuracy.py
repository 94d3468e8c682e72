"""Accuracy and speed of a quantized KV cache (--kv-cache-dtype int8 / fp8) against the full dtype,
on the default model (SmolLM2-135M, float32 on CPU) (issue 13).

    .venv/bin/python benchmarks/kv_cache_dtype_accuracy.py                       # the recorded run
    .venv/bin/python benchmarks/kv_cache_dtype_accuracy.py --prompts 4 --max-tokens 16 --timing-context 256

Three measurements per KV dtype, the same inputs for each:

    greedy    the engine (scheduler + runner, prefix caching on) generates --max-tokens greedy tokens
              (ignore_eos) for --prompts chat prompts: the fraction of requests whose tokens equal the
              full dtype's, and the mean number of tokens before the first difference (a request
              that never differs counts --max-tokens)
    logits    teacher-forced: each prompt followed by the full dtype's greedy output, run through the
              model over a paged pool of that dtype (the prompt as one chunk, then one token per
              forward, all requests batched: the decode path the engine takes); at every output
              position max and mean |logit - logit_full| and whether the argmax agrees
    speed     --timing-batch requests of --timing-context random tokens: prefill time of that batch,
              and the median decode step over --timing-steps steps (the CPU paged kernel reads int8
              codes directly; fp8 takes the gather path)
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import assemble_engine
from servelm.models.factory import build_model
from servelm.models.llama import LlamaForCausalLM
from servelm.models.loader import load_checkpoint
from servelm.sampling_params import SamplingParams
from servelm.testing.engine_run import run_requests
from servelm.worker.kv_cache import allocate_kv_caches, resolve_kv_dtype
from servelm.worker.model_runner import attention_backend_of
from servelm.worker.paged_inputs import paged_attention_inputs

QUESTIONS = [
    "What is the capital of France, and what is it known for?",
    "Explain in two sentences how a hash table works.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for getting better sleep.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a simple tomato sauce?",
    "What is the difference between a list and a tuple in Python?",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What are the main causes of inflation?",
    "Explain recursion to a ten-year-old.",
    "List the planets of the solar system in order.",
    "How does a vaccine train the immune system?",
    "Translate 'Good morning, how are you?' into Spanish.",
    "What should I consider when buying a used car?",
]
BLOCK_SIZE = 16


@dataclass
class Accuracy:
    identical: float  # fraction of requests with the full dtype's greedy tokens
    tokens_to_divergence: float  # mean tokens before the first difference
    max_logit_error: float
    mean_logit_error: float
    top1_agreement: float  # teacher-forced positions whose argmax is the full dtype's


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )  # fmt: skip
        for q in questions
    ]


def greedy(model, checkpoint, kv_cache_dtype: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    config = EngineConfig.from_flat(kv_cache_dtype=kv_cache_dtype, num_blocks=512, block_size=BLOCK_SIZE)
    built = assemble_engine(config, model, checkpoint.arch, checkpoint.tokenizer, checkpoint.source)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [
        EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=params) for i, p in enumerate(prompts)
    ]
    run = run_requests(built.core, requests, [0] * len(requests))
    return [run.tokens[str(i)] for i in range(len(prompts))]


class PagedBatch:
    """R sequences over a paged pool of one KV dtype, each in its own contiguous blocks."""

    def __init__(self, model: LlamaForCausalLM, kv_dtype: torch.dtype, max_lens: list[int]) -> None:
        self.model, self.backend = model, attention_backend_of(model)
        widths = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in max_lens]
        self.table = torch.zeros(len(max_lens), max(widths), dtype=torch.int32)  # [R, max_blocks]
        first = 0
        for row, width in enumerate(widths):
            self.table[row, :width] = torch.arange(first, first + width, dtype=torch.int32)
            first += width
        self.kv_caches = allocate_kv_caches(model.arch, first, BLOCK_SIZE, kv_dtype, torch.device("cpu"))
        self.kv_dtype = kv_dtype

    @torch.inference_mode()
    def forward(self, rows: list[int], starts: list[int], token_ids: list[list[int]]) -> torch.Tensor:
        """Feed token_ids[i] to row rows[i] at positions starts[i]..; the logits after each one's last token."""
        query_lens = torch.tensor([len(t) for t in token_ids])
        positions, common = paged_attention_inputs(
            self.table, torch.tensor(rows), torch.tensor(starts), query_lens, BLOCK_SIZE, torch.device("cpu"),
            torch.float32, self.kv_dtype,
        )  # fmt: skip
        ids = torch.tensor([t for tokens in token_ids for t in tokens])
        hidden = self.model(ids, positions, self.backend.build_metadata(common), self.kv_caches)
        return self.model.compute_logits(hidden[common.query_start_loc[1:].long() - 1])  # [R, vocab]


def teacher_forced_logits(
    model, kv_dtype: torch.dtype, prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """[R, max_tokens, vocab]: logits predicting output token j after the prompt and outputs[:j]."""
    batch = PagedBatch(model, kv_dtype, [len(p) + len(o) for p, o in zip(prompts, outputs)])
    rows = list(range(len(prompts)))
    steps = [torch.cat([batch.forward([r], [0], [prompts[r]]) for r in rows])]  # each prompt alone, one chunk
    for j in range(len(outputs[0]) - 1):
        steps.append(batch.forward(rows, [len(p) + j for p in prompts], [[o[j]] for o in outputs]))
    return torch.stack(steps, dim=1)


def accuracy(reference_tokens, tokens, reference_logits, logits) -> Accuracy:
    divergence = []
    for ref, got in zip(reference_tokens, tokens):
        diff = [i for i, (a, b) in enumerate(zip(ref, got)) if a != b]
        divergence.append(diff[0] if diff else len(ref))
    error = (logits - reference_logits).abs()
    return Accuracy(
        identical=sum(a == b for a, b in zip(reference_tokens, tokens)) / len(tokens),
        tokens_to_divergence=statistics.mean(divergence),
        max_logit_error=float(error.max()),
        mean_logit_error=float(error.mean()),
        top1_agreement=float((logits.argmax(-1) == reference_logits.argmax(-1)).float().mean()),
    )


def speed(model, kv_dtype: torch.dtype, batch_size: int, context: int, steps: int) -> tuple[float, float]:
    """Seconds to prefill `batch_size` prompts of `context` tokens (one request per forward, as
    chunks of a whole prompt), and the median seconds of a decode step of the whole batch."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.arch.vocab_size, (batch_size, context), generator=gen).tolist()
    batch = PagedBatch(model, kv_dtype, [context + steps] * batch_size)
    rows = list(range(batch_size))
    started = time.perf_counter()
    for r in rows:
        batch.forward([r], [0], [prompts[r]])
    prefill = time.perf_counter() - started
    times = []
    for j in range(steps):
        started = time.perf_counter()
        batch.forward(rows, [context + j] * batch_size, [[1 + j]] * batch_size)
        times.append(time.perf_counter() - started)
    return prefill, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="int8,fp8", help="quantized KV dtypes to compare with the full one")
    parser.add_argument("--timing-batch", type=int, default=8)
    parser.add_argument("--timing-context", type=int, default=1024)
    parser.add_argument("--timing-steps", type=int, default=16)
    args = parser.parse_args()

    checkpoint = load_checkpoint(None)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu")
    cpu = torch.device("cpu")
    prompts = chat_prompts(checkpoint.tokenizer, args.prompts)
    print(f"{len(prompts)} chat prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} greedy tokens each; {torch.get_num_threads()} threads")  # fmt: skip
    reference_tokens = greedy(model, checkpoint, "auto", prompts, args.max_tokens)
    reference_logits = teacher_forced_logits(model, torch.float32, prompts, reference_tokens)
    full_speed = speed(model, torch.float32, args.timing_batch, args.timing_context, args.timing_steps)

    print("\n| KV dtype | identical greedy requests | mean tokens to first difference | max abs logit error "
          "| mean abs logit error | top-1 agreement (teacher-forced) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    timings = {"float32 (auto)": full_speed}
    for name in args.dtypes.split(","):
        kv_dtype = resolve_kv_dtype(name, torch.float32, cpu)
        tokens = greedy(model, checkpoint, name, prompts, args.max_tokens)
        logits = teacher_forced_logits(model, kv_dtype, prompts, reference_tokens)
        a = accuracy(reference_tokens, tokens, reference_logits, logits)
        print(f"| {name} | {a.identical:.1%} ({round(a.identical * len(prompts))}/{len(prompts)}) "
              f"| {a.tokens_to_divergence:.1f} / {args.max_tokens} | {a.max_logit_error:.3f} "
              f"| {a.mean_logit_error:.4f} | {a.top1_agreement:.2%} |")  # fmt: skip
        timings[name] = speed(model, kv_dtype, args.timing_batch, args.timing_context, args.timing_steps)

    print(f"\nSpeed: {args.timing_batch} requests x {args.timing_context} tokens of context")
    print("\n| KV dtype | prefill of the batch (s) | decode step, median (ms) | vs float32 |")
    print("|---|---:|---:|---:|")
    for name, (prefill, step) in timings.items():
        print(f"| {name} | {prefill:.2f} | {step * 1000:.1f} | {step / full_speed[1]:.2f}x |")


if __name__ == "__main__":
    main()
