"""A stream decoding when a turn arrives whose long context is cached: the stream's gaps.

The step budget under the step-time target (`--max-step-ms`, default 200 ms) is priced at the
depth of the deepest prompt mid-prefill, set before admission; a turn admitted after a long
prefix hit is deeper: each of its new tokens attends to the whole cached context. The mixed
profile's code turns are such (e.g. 657 new tokens after 2,528 cached). Per trial: a context
(`--context` tokens) prefills alone and stays cached, a voice-like stream starts decoding, then
the turn (the context + `--new` tokens, max_tokens 1) arrives. Reported: the stream's worst gap
while the turn prefills, the gaps over the target, and the turn's TTFT. Engine in process,
default model and settings. With --baseline-src the same trials run in a subprocess against
another checkout's src/ after (baseline_checkout.py).

    PYTHONPATH=src .venv/bin/python benchmarks/turn_after_prefix_hit.py --cases 2528+657,3072+115 --baseline-src ../base/src
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from baseline_checkout import parse_and_measure
from prefill_after_context import parse_cases

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import build_engine
from servelm.sampling_params import SamplingParams

TARGET_S = 0.2  # the default --max-step-ms


def trials(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    core = build_engine(EngineConfig.from_flat(max_model_len=8192)).core
    gen = torch.Generator().manual_seed(args.seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 10000, (n,), generator=gen).tolist()

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))

    results: dict[str, dict[str, list[float]]] = {}
    for context_len, new_len in parse_cases(args.cases):
        case = f"{context_len}+{new_len}"
        worst, over, ttft = [], [], []
        for trial in range(args.trials):
            context = tokens(context_len)
            add(f"context{case}-{trial}", context, 1)
            while core.has_work():
                core.step()
            stream = f"stream{case}-{trial}"
            add(stream, tokens(120), 100_000)
            for _ in range(4):  # its prompt and a few decodes: it is streaming when the turn comes
                core.step()
            turn = f"turn{case}-{trial}"
            add(turn, context + tokens(new_len), 1)
            sent = last = time.perf_counter()
            gaps: list[float] = []
            done = None
            while done is None:
                outputs = core.step()
                now = time.perf_counter()
                for output in outputs:
                    if output.request_id == stream and output.new_token_ids:
                        gaps.append(now - last)
                        last = now
                    if output.request_id == turn and output.new_token_ids:
                        done = now
            core.abort_requests([stream])
            core.step()
            worst.append(max(gaps))
            over.append(float(sum(gap > TARGET_S for gap in gaps)))
            ttft.append(done - sent)
        results[case] = {"worst_gap_s": worst, "gaps_over_target": over, "turn_ttft_s": ttft}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="2528+657,3072+115", help="CACHED+NEW tokens, comma-separated")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args, rows = parse_and_measure(parser, __file__, trials)
    if rows is None:
        return
    print(
        f"| cached + new | system | stream worst gap p50 (ms) | per trial (ms) | gaps over {TARGET_S * 1000:.0f} ms | turn TTFT p50 (ms) |"
    )
    print("|---|---|---:|---|---:|---:|")
    for context_len, new_len in parse_cases(args.cases):
        case = f"{context_len}+{new_len}"
        for name, results in rows.items():
            r = results[case]
            print(f"| {case} | {name} | {statistics.median(r['worst_gap_s']) * 1000:.0f} | "
                  f"{', '.join(f'{g * 1000:.0f}' for g in r['worst_gap_s'])} | {sum(r['gaps_over_target']):.0f} | "
                  f"{statistics.median(r['turn_ttft_s']) * 1000:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
