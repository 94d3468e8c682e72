"""Prefill time on the default model for prompts that arrive cold or after a prefix hit: what a
code assistant's first turn (a cold 3-4k-token context) and its next turns (a few hundred to
1.5k new tokens after a cached 2-3k) cost the engine, at the default step budget (a cold prompt
over 2,048 tokens is two chunks, the second one attending to the first's cached K/V).

Each case: the context alone first (untimed: it fills the prefix cache), then context + new
tokens with max_tokens=1, timed from add_request to the finished output; median of --repeats
(fresh random tokens each repeat). With --baseline-src the same cases run in a subprocess
against another checkout's src/ (baseline_checkout.py).

    PYTHONPATH=src .venv/bin/python benchmarks/prefill_after_context.py
    PYTHONPATH=src .venv/bin/python benchmarks/prefill_after_context.py --baseline-src ../base/src
    # voice- and chat-sized prompts instead (CACHED+NEW each):
    PYTHONPATH=src .venv/bin/python benchmarks/prefill_after_context.py --cases 0+63,0+159,144+178,0+512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from baseline_checkout import parse_and_measure

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import build_engine
from servelm.sampling_params import SamplingParams

# (cached context tokens, new tokens): cold prompts of the mixed profile's code contexts, and
# code turns after a prefix hit (their sizes in the mixed run of benchmarks/RESULTS.md, issue 11).
CASES = "0+4021,0+2764,1600+1564,2528+657,3072+128"


def parse_cases(text: str) -> list[tuple[int, int]]:
    """The --cases text, "CACHED+NEW,...", as [(cached, new), ...]."""
    cases = []
    for item in text.split(","):
        cached, new = item.split("+")
        cases.append((int(cached), int(new)))
    return cases


def measure(cases: list[tuple[int, int]], repeats: int) -> dict[str, float]:
    core = build_engine(EngineConfig.from_flat(max_model_len=8192)).core
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    counter = iter(range(1_000_000))

    def run(prompt: list[int]) -> float:
        core.add_request(EngineRequest(request_id=f"r{next(counter)}", prompt_token_ids=prompt, sampling_params=params))
        started = time.perf_counter()
        while not any(out.finish_reason is not None for out in core.step()):
            pass
        return time.perf_counter() - started

    run(torch.randint(100, 10000, (512,), generator=gen).tolist())  # the step cost model and kernels warm
    results = {}
    for cached, new in cases:
        times = []
        for _ in range(repeats):
            prompt = torch.randint(100, 10000, (cached + new,), generator=gen).tolist()
            if cached:
                run(prompt[:cached])
            times.append(run(prompt))
        results[f"{cached}+{new}"] = statistics.median(times)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=CASES, help="CACHED+NEW tokens, comma-separated (default: %(default)s)")
    args, rows = parse_and_measure(parser, __file__, lambda a: measure(parse_cases(a.cases), a.repeats))
    if rows is None:
        return
    ours, baseline = rows["this checkout"], rows.get("baseline")
    print("| cached + new tokens | this checkout (s) | baseline (s) | ratio |")
    print("|---|---:|---:|---:|")
    for case, seconds in ours.items():
        base = baseline[case] if baseline else None
        ratio = f"{seconds / base:.2f}x" if base else "—"
        print(f"| {case} | {seconds:.3f} | {f'{base:.3f}' if base else '—'} | {ratio} |")


if __name__ == "__main__":
    main()
