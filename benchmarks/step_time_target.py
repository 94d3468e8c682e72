"""What `--max-step-ms` buys a stream that is decoding when a long prompt arrives.

One stream decodes; after its first `--lead-tokens` tokens a long prompt (`--long-prompt`
tokens) arrives. Without a target the long prompt's first chunk (up to max_num_batched_tokens)
shares a step with the stream's next token, which waits for the whole chunk; with a target the
chunks shrink to what the learned step cost says fits, while the stream keeps decoding.
Reported per setting: the stream's median and worst inter-token gap while the long prompt is
being prefilled, and the long prompt's TTFT. The engine runs in this process (no HTTP), on the
default model unless `--model` says otherwise; settings run one after the other, each on a
freshly built engine, in the order given.

    .venv/bin/python benchmarks/step_time_target.py --targets 0,250,100
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import build_engine
from servelm.sampling_params import SamplingParams


def run_one(args: argparse.Namespace, max_step_ms: float) -> dict[str, float]:
    config = EngineConfig.from_flat(
        model=args.model, num_threads=args.threads, max_num_batched_tokens=args.budget, max_step_ms=max_step_ms
    )
    core = build_engine(config).core
    rng = random.Random(args.seed)
    vocab = 1000  # ordinary token ids; the content does not matter for timing
    stream = EngineRequest(
        request_id="stream", prompt_token_ids=[rng.randrange(vocab) for _ in range(32)],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True),
    )  # fmt: skip
    long_prompt = EngineRequest(
        request_id="long", prompt_token_ids=[rng.randrange(vocab) for _ in range(args.long_prompt)],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    )  # fmt: skip
    core.add_request(stream)
    stream_times: list[float] = []
    long_sent = long_done = None
    while long_done is None or len(stream_times) < args.lead_tokens * 2 + 4:
        outputs = core.step()
        now = time.perf_counter()
        for output in outputs:
            if output.request_id == "stream" and output.new_token_ids:
                stream_times.append(now)
            if output.request_id == "long" and output.new_token_ids:
                long_done = now
        if long_sent is None and len(stream_times) >= args.lead_tokens:
            core.add_request(long_prompt)
            long_sent = time.perf_counter()
    core.abort_requests(["stream"])
    core.step()
    gaps = [b - a for a, b in zip(stream_times, stream_times[1:]) if b > long_sent and a < long_done]
    return {
        "tbt_p50_ms": 1000 * statistics.median(gaps),
        "tbt_max_ms": 1000 * max(gaps),
        "long_ttft_ms": 1000 * (long_done - long_sent),
        "stream_tokens_during_prefill": float(len(gaps)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--targets", default="0,250,100", help="max_step_ms settings, comma-separated (0 = off)")
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--lead-tokens", type=int, default=16, help="stream tokens before the long prompt arrives")
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| max_step_ms | stream TBT p50 during prefill (ms) | stream TBT max (ms) | stream tokens during prefill | long prompt TTFT (ms) |")
    print("|---|---|---|---|---|")
    for target in (float(t) for t in args.targets.split(",")):
        r = run_one(args, target)
        print(f"| {target:g} | {r['tbt_p50_ms']:.0f} | {r['tbt_max_ms']:.0f} | {r['stream_tokens_during_prefill']:.0f} | "
              f"{r['long_ttft_ms']:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
