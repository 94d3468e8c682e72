"""A short prompt arriving while a long prompt prefills next to a decoding stream: its TTFT.

The mixed profile's worst realtime case (issue 11): a voice prompt of ~80 new tokens arrives
while a code assistant's cold 2-4k-token context prefills and another request decodes, so every
step is held to the step-time target (`--max-step-ms`, 200 ms by default) and the step budget
is priced at the long prompt's depth. Per trial a long prompt (`--long` tokens) is added, and
`--short` tokens arrive `offset` seconds later (offsets spread over the long prompt's prefill,
so the short one meets it at every depth); the short prompt's TTFT counts from that arrival
time, so the wait for the step in flight is in it, as it is for a request reaching a server. One
stream decodes throughout. The engine runs in this process (default model), built once; with
--baseline-src the same trials run in a subprocess against another checkout's src/ after
(baseline_checkout.py).

    PYTHONPATH=src .venv/bin/python benchmarks/short_beside_long.py
    PYTHONPATH=src .venv/bin/python benchmarks/short_beside_long.py --baseline-src ../base/src
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


def trials(args: argparse.Namespace) -> dict[str, list[float]]:
    core = build_engine(EngineConfig.from_flat(max_model_len=8192)).core
    gen = torch.Generator().manual_seed(args.seed)
    first_token: dict[str, float] = {}

    def add(request_id: str, num_tokens: int, max_tokens: int) -> None:
        prompt = torch.randint(100, 10000, (num_tokens,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))

    def step() -> None:
        for out in core.step():
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter()

    add("warm", 512, 1)  # kernels and the step cost model
    while "warm" not in first_token:
        step()
    add("stream", 1000, 1_000_000)
    while "stream" not in first_token:
        step()
    short_ttft, long_ttft = [], []
    for trial in range(args.trials):
        offset = args.first_offset_s + trial * args.offset_step_s
        started = time.perf_counter()
        add(f"long{trial}", args.long, 1)
        arrival = started + offset
        while time.perf_counter() < arrival:
            step()  # the short prompt arrives mid-step: it is added at the step's end
        add(f"short{trial}", args.short, 1)
        while f"long{trial}" not in first_token or f"short{trial}" not in first_token:
            step()
        short_ttft.append(first_token[f"short{trial}"] - arrival)
        long_ttft.append(first_token[f"long{trial}"] - started)
    return {"short_ttft_s": short_ttft, "long_ttft_s": long_ttft}


def summary(results: dict[str, list[float]]) -> str:
    short, long = results["short_ttft_s"], results["long_ttft_s"]
    return (f"{statistics.median(short) * 1000:.0f} | {max(short) * 1000:.0f} | "
            f"{statistics.median(long):.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", type=int, default=2764)
    parser.add_argument("--short", type=int, default=83)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--first-offset-s", type=float, default=0.3)
    parser.add_argument("--offset-step-s", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0)
    args, rows = parse_and_measure(parser, __file__, trials)
    if rows is None:
        return
    print(f"short {args.short} tokens beside long {args.long}, {args.trials} trials")
    print("| system | short TTFT p50 (ms) | short TTFT max (ms) | long TTFT p50 (s) |")
    print("|---|---:|---:|---:|")
    for name, results in rows.items():
        print(f"| {name} | {summary(results)} |")
    for name, results in rows.items():
        print(name, "short TTFT ms:", [round(t * 1000) for t in results["short_ttft_s"]])


if __name__ == "__main__":
    main()
