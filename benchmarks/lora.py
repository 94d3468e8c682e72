"""Multi-LoRA on this host (issue 42): decode throughput with adapters against the base model, and
how long an adapter takes to load. Offline, the real engine (`LLM`), the default model.

    base         the default model at its defaults (no --enable-lora: fused decode layers on)
    one adapter  --enable-lora, every request on the same rank-16 adapter (all seven projections)
    8 distinct   --max-loras 8, each of the batch's 8 requests on its own rank-16 adapter
    100 adapters --max-loras 8 over 100 registered adapters, each request on one drawn uniformly:
                 slots change hands as the batch turns over

Each case decodes `--requests` requests of `--prompt-tokens` random tokens and `--max-tokens`
outputs (ignore_eos), at most `--batch` at once; throughput = output tokens / wall time of generate().
Targets: one adapter >= 0.85x base, 8 distinct >= 0.75x base, 100 adapters >= 0.7x one adapter;
a rank-16 adapter of the default model loaded (read, checked, copied into a slot) in <= 200 ms,
measured in-process and through a real server's POST /v1/load_lora_adapter (to its 200, then a
1-token request naming the adapter, which copies it into a slot).

    PYTHONPATH=src .venv/bin/python benchmarks/lora.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from servelm.engine.llm import LLM
from servelm.lora.adapter import load_lora_adapter
from servelm.models.loader import load_checkpoint
from servelm.sampling_params import SamplingParams
from servelm.server.launcher import launch_server
from servelm.testing.lora_adapters import write_peft_adapter


def throughput(llm: LLM, names: list[str | None], args: argparse.Namespace, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in names]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), lora_name=names[:2])  # warm
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_name=names)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=100)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    arch = load_checkpoint(None).arch
    engine = {"max_num_seqs": args.batch, "num_blocks": 1024}
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_peft_adapter(Path(tmp) / f"a{i}", arch, args.rank, seed=i) for i in range(args.num_adapters)]
        load_ms = []
        for path in paths[:5]:
            started = time.perf_counter()
            load_lora_adapter("a", path, arch, args.rank)
            load_ms.append(1e3 * (time.perf_counter() - started))
        with LLM(**engine) as llm:
            results["base"] = throughput(llm, [None] * args.requests, args, 1)
        modules = [f"a{i}={path}" for i, path in enumerate(paths)]
        lora = {"enable_lora": True, "max_lora_rank": args.rank, "max_loras": args.batch}
        with LLM(lora_modules=modules[: args.batch], **lora, **engine) as llm:
            results["base, --enable-lora"] = throughput(llm, [None] * args.requests, args, 1)
            results["one adapter"] = throughput(llm, ["a0"] * args.requests, args, 1)
            results["8 distinct"] = throughput(llm, [f"a{i % args.batch}" for i in range(args.requests)], args, 1)
        with LLM(lora_modules=modules, **lora, **engine) as llm:
            rng = random.Random(7)
            results["100 adapters"] = throughput(llm, [f"a{rng.randrange(args.num_adapters)}" for _ in range(args.requests)],
                                                 args, 1)  # fmt: skip
            slot_ms = _slot_copy_ms(llm)
        api_ms = _runtime_load_ms(paths[:5])
    print(f"\nload of a rank-{args.rank} adapter of the default model (read + checks): median "
          f"{statistics.median(load_ms):.0f} ms; copy into a slot: {slot_ms:.1f} ms; through the API "
          f"(POST /v1/load_lora_adapter to its 200, then the first request with it): median "
          f"{statistics.median(api_ms):.0f} ms (each: {', '.join(f'{ms:.0f}' for ms in api_ms)})\n")  # fmt: skip
    print("| case | output tok/s | vs base | vs one adapter |")
    print("|---|---:|---:|---:|")
    for name, value in results.items():
        print(f"| {name} | {value:.1f} | {value / results['base']:.2f}x | {value / results['one adapter']:.2f}x |")


def _runtime_load_ms(paths: list[Path]) -> list[float]:
    """A real server of the default model (--allow-runtime-lora-updating): for each adapter, the time
    from POST /v1/load_lora_adapter to its 200, plus a 1-token request naming it (the slot copy)."""
    server = launch_server(None, ["--enable-lora", "--allow-runtime-lora-updating", "--max-lora-rank", "64"])
    try:
        times = []
        for i, path in enumerate(paths):
            started = time.perf_counter()
            load = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": f"rt{i}", "lora_path": str(path)},
                              timeout=60)  # fmt: skip
            first = httpx.post(f"{server.base_url}/v1/completions", json={"model": f"rt{i}", "prompt": "Hi", "max_tokens": 1},
                               timeout=60)  # fmt: skip
            times.append(1e3 * (time.perf_counter() - started))
            assert load.status_code == 200 and first.status_code == 200, (load.text, first.text)
        return times
    finally:
        server.stop()


def _slot_copy_ms(llm: LLM) -> float:
    """Median time to copy a resident adapter into slot 0 again (what a slot changing hands costs)."""
    slots = llm.engine.core.runner.lora
    assert slots is not None
    adapter = slots.registry.get("a0")
    times = []
    for _ in range(5):
        started = time.perf_counter()
        slots.model.set_slot(0, adapter)
        times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)  # (slot 0 holds a0 again: nothing runs on this engine after)


if __name__ == "__main__":
    main()
