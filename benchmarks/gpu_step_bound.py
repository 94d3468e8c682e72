"""Issue 38 on a GPU: the step-time bound, the calibrated cost model and layered prefill on CUDA.

On a random-weight Llama of a 1B-class shape (gpu_checks.SHAPES, bfloat16; in process, no HTTP):

    1. calibration  the cost model's prices after start-up, and the default target it gives
    2. equivalence  greedy tokens of long and short prompts with the bound (layered prefill on),
                    token chunks only, and no bound: the share that agree (bfloat16: chunk shapes
                    may flip near-ties, so a count, not an assertion)
    3. short after long   a --long-token prompt starts, a 16-token one arrives --offset of the way
                    through its unchunked prefill: both TTFTs, the steps' times against the
                    target, the prediction's measured / predicted by kind; the long prompt alone
                    unchunked (one step) and at defaults

    python3 benchmarks/gpu_step_bound.py --out $OUT     (on the device: gpu_env.sh first)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_checks import SHAPES, random_engine

from servelm.datatypes import EngineRequest
from servelm.engine.builder import BuiltEngine
from servelm.sampling_params import SamplingParams
from servelm.scheduler.step_cost import FEATURES


def _engine(shape: str, device: str, **flags: Any) -> BuiltEngine:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return random_engine(shape, device, dtype, kv_gib=8.0 if device == "cuda" else 0.5, **flags)[0]


def _run(built: BuiltEngine, requests: list[tuple[str, list[int], int, float]]) -> dict[str, Any]:
    """Requests (id, prompt, max_tokens, arrival offset s) into the core, stepping until done: first-token
    times from each arrival, step times and tokens."""
    core, params = built.core, {}
    pending = sorted(requests, key=lambda r: r[3])
    first: dict[str, float] = {}
    arrived: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    steps: list[float] = []
    core.scheduler.step_log.take_predictions()
    start = time.perf_counter()
    while pending or core.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][3] <= now:
            rid, prompt, max_tokens, _ = pending.pop(0)
            params[rid] = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            core.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params[rid]))
            arrived[rid] = time.perf_counter()
        if not core.has_work():
            time.sleep(0.0005)
            continue
        began = time.perf_counter()
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - arrived[out.request_id]
        steps.append(time.perf_counter() - began)
    predictions = core.scheduler.step_log.take_predictions()
    return {"ttft_s": first, "tokens": tokens, "steps_s": steps, "predictions": predictions}


def _ratios(predictions: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for kind in sorted({k for k, _, _ in predictions}):
        ratios = sorted(m / p for k, p, m in predictions if k == kind)
        out[kind] = {"count": len(ratios), "p10": ratios[len(ratios) // 10], "p50": ratios[len(ratios) // 2],
                     "p90": ratios[(9 * len(ratios)) // 10]}  # fmt: skip
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--long", type=int, default=8000)
    parser.add_argument("--offset", type=float, default=0.3, help="share of the unchunked prefill after which the short one arrives")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu_step_bound"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(38)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device}
    empty_cache = torch.cuda.empty_cache if args.device == "cuda" else (lambda: None)

    built = _engine(args.shape, args.device)
    vocab = built.arch.vocab_size
    model = built.core.scheduler.step_cost
    report["calibration"] = {
        "coefficients": dict(zip(FEATURES, model.coefficients() or ())),
        "fixed_s": model.calibrated_fixed_s,
        "target_s": built.core.scheduler.step_target_s(),
    }
    print(json.dumps(report, indent=2), flush=True)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    # 2. equivalence
    prompts = [(f"p{i}", prompt(n), 16, 0.0) for i, n in enumerate((3000, 6000, 700, 40))]
    runs = {"bound": _run(built, prompts)}
    for name, knobs in (("token-chunks", {"layered_prefill": False}), ("unbounded", {"max_step_ms": 0.0})):
        other = _engine(args.shape, args.device, **knobs)
        runs[name] = _run(other, prompts)
        del other
        empty_cache()
    agree = {
        name: sum(runs["bound"]["tokens"][rid] == run["tokens"][rid] for rid, *_ in prompts)
        for name, run in runs.items() if name != "bound"
    }
    report["equivalence"] = {"prompts": len(prompts), "same_greedy_tokens_as_bound": agree}
    print("equivalence", agree, flush=True)

    # 3. the long prompt alone, unchunked and at defaults; then with a short one arriving
    unchunked = _engine(args.shape, args.device, max_step_ms=0.0, max_num_batched_tokens=args.long)
    _run(unchunked, [("warm", prompt(args.long), 1, 0.0)])
    alone_unchunked = _run(unchunked, [("long", prompt(args.long), 1, 0.0)])["ttft_s"]["long"]
    del unchunked
    empty_cache()
    _run(built, [("warm", prompt(args.long), 1, 0.0)])
    alone = _run(built, [("long", prompt(args.long), 1, 0.0)])
    offset = args.offset * alone_unchunked
    mixed = _run(built, [("long", prompt(args.long), 1, 0.0), ("short", prompt(16), 16, offset)])
    target = built.core.scheduler.step_target_s() or 0.0
    report["short_after_long"] = {
        "long_tokens": args.long,
        "target_s": target,
        "long_alone_unchunked_ttft_s": alone_unchunked,
        "long_alone_ttft_s": alone["ttft_s"]["long"],
        "long_alone_vs_unchunked": alone["ttft_s"]["long"] / alone_unchunked,
        "alone_steps": len(alone["steps_s"]),
        "alone_step_p50_s": statistics.median(alone["steps_s"]),
        "alone_step_p99_s": _quantile(alone["steps_s"], 0.99),
        "alone_prediction_ratio": _ratios(alone["predictions"]),
        "short_offset_s": offset,
        "long_ttft_s": mixed["ttft_s"]["long"],
        "short_ttft_s": mixed["ttft_s"]["short"],
        "short_vs_long": mixed["ttft_s"]["short"] / mixed["ttft_s"]["long"],
        "mixed_prediction_ratio": _ratios(mixed["predictions"]),
    }
    print(json.dumps(report["short_after_long"], indent=2), flush=True)
    (args.out / "gpu_step_bound.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
