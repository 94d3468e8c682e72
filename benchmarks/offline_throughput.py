"""Offline throughput of the default model (SmolLM2-135M) on CPU: servelm vs transformers vs vLLM-CPU.

Three measurements, the same for every system, with the same prompts (seeded random token ids):

    offline   64 prompts of 128-512 tokens, 128 output tokens each (greedy, ignore_eos), all
              submitted at once: prompt, output and total tokens/s over the whole run's wall time
              (vLLM's benchmark_throughput convention)
    decode    one 128-token prompt; (time to 129 output tokens - time to 1) / 128 = ms per decode step
    prefill   one 3,000-token prompt, 1 output token: prompt tokens/s

Each system lives in its own worker process (vLLM in its own venv: benchmarks/vllm_cpu/setup.sh),
loaded once; the parent sends tasks one at a time, interleaving systems round by round, so drift
in machine load (other jobs on the same cores) hits all systems alike. Figures are medians over
rounds; ratios are taken round by round, then the median.

    .venv/bin/python benchmarks/offline_throughput.py                                # all systems
    .venv/bin/python benchmarks/offline_throughput.py --systems servelm,transformers --rounds 1
    .venv/bin/python benchmarks/offline_throughput.py --results benchmarks/RESULTS.md
    .venv/bin/python benchmarks/offline_throughput.py --systems servelm,baseline --baseline-src ../base/src
                                                  # this checkout vs another one (before/after a change)

The worker half (`--worker NAME`) imports only what its system needs, so the vLLM venv runs this
file without servelm installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = HERE / "vllm_cpu" / ".venv" / "bin" / "python"
RESULT_PREFIX = "@@RESULT "
# Per-token cost of SmolLM2-135M: 2 FLOP per weight (134.5M incl. the tied lm_head) ≈ 0.27 GFLOP.
GFLOP_PER_TOKEN = 0.27
MATMUL_GFLOPS_FP32 = 330.0  # the figure for "this kind of machine": its nominal ceiling's basis
# One layer's weight matmuls of SmolLM2 (hidden 576, 9+3+3 heads of 64, intermediate 1536) as (in, out).
LAYER_MATMULS = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def measure_matmul_gflops(threads: int, rows: int = 2048, repeats: int = 5) -> float:
    """float32 GEMM rate of the model's own layer shapes at `rows` tokens with `threads` threads,
    measured now: the compute ceiling of this machine at this moment (tokens/s = GFLOP/s / 0.27)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = {k: torch.randn(rows, k) for k, _ in LAYER_MATMULS}
        weights = [(x[k], torch.randn(k, n)) for k, n in LAYER_MATMULS]
        flop = sum(2 * rows * k * n for k, n in LAYER_MATMULS)
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass warms MKL up
            t0 = time.perf_counter()
            for a, b in weights:
                a @ b
            best = min(best, time.perf_counter() - t0)
        return flop / best / 1e9
    finally:
        torch.set_num_threads(previous)


# -- workload ---------------------------------------------------------------------------------


def make_workload(args: argparse.Namespace, vocab_size: int) -> dict:
    """Seeded prompts; every round gets its own (same lengths, fresh tokens), and so does the
    warm-up, so no system's prefix cache ever hits: each round measures full prompt processing."""
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, vocab_size - 1000) for _ in range(n)]  # clear of special tokens

    lens = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.num_prompts)]

    def round_prompts() -> dict:
        return {
            "offline": [prompt(n) for n in lens],
            # Two different prompts of one length: (129 tokens) - (1 token), neither cached.
            "decode_one": prompt(128),
            "decode_many": prompt(128),
            "prefill": prompt(args.prefill_len),
        }

    return {
        "warmup": [prompt(n) for n in lens[:8]],
        "rounds": [round_prompts() for _ in range(args.rounds)],
        "output_len": args.output_len,
        "decode_tokens": 128,
        "threads": args.threads,
        "max_model_len": max(args.prefill_len, args.max_prompt) + args.output_len + 8,
        "hf_batch_size": args.hf_batch_size,
        "servelm_dtype": args.servelm_dtype,
        "servelm_batched_tokens": args.servelm_batched_tokens,
        "vllm_omp_bind": args.vllm_omp_bind,
    }


# -- workers: one per system, each a loaded model answering tasks -----------------------------


class ServelmSystem:
    def __init__(self, model_dir: str, w: dict) -> None:
        from servelm import LLM
        from servelm.sampling_params import SamplingParams

        self.sp = SamplingParams
        self.llm = LLM(
            None,  # the embedded GGUF; model_dir holds the same weights for the others
            dtype=w["servelm_dtype"],
            num_threads=w["threads"],
            max_model_len=w["max_model_len"],
            max_num_batched_tokens=w["servelm_batched_tokens"],
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = self.sp(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate(prompts, params)
        return sum(len(o.outputs[0].token_ids) for o in outs)


class TransformersSystem:
    """Batched, left-padded `generate`, prompts sorted by length so batches pad little."""

    def __init__(self, model_dir: str, w: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(w["threads"])
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        self.batch_size = w["hf_batch_size"]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        torch = self.torch
        produced = 0
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for b in range(0, len(order), self.batch_size):
            batch = [prompts[i] for i in order[b : b + self.batch_size]]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,  # ignore_eos
                    do_sample=False,
                    pad_token_id=0,
                )
            produced += (out.shape[1] - width) * len(batch)
        return produced


class VllmSystem:
    """vLLM's CPU build with its own defaults, except the KV pool: 2 GiB like servelm's.

    Its default thread binding (VLLM_CPU_OMP_THREADS_BIND=auto) on 2 cores runs the model on
    one core and leaves the other to its engine/front-end processes; `--vllm-omp-bind 0-1`
    gives the model both.
    """

    dtype = "bfloat16"

    def __init__(self, model_dir: str, w: dict) -> None:
        if w["vllm_omp_bind"]:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = w["vllm_omp_bind"]
        from vllm import LLM, SamplingParams

        self.sp = SamplingParams
        self.llm = LLM(
            model=model_dir,
            dtype=self.dtype,
            max_model_len=w["max_model_len"],
            kv_cache_memory_bytes=2 * 2**30,
            gpu_memory_utilization=0.3,  # the CPU backend's share of RAM; unused with an explicit KV size
            seed=0,
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = self.sp(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)


class VllmFp32System(VllmSystem):
    dtype = "float32"


SYSTEMS = {
    "servelm": ServelmSystem,
    # The same worker importing servelm from another checkout (--baseline-src): before/after
    # comparisons of a change, round by round on the same machine load.
    "baseline": ServelmSystem,
    "transformers": TransformersSystem,
    "vllm": VllmSystem,  # bfloat16, vLLM's usual CPU dtype
    "vllm-fp32": VllmFp32System,
}


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'servelm@1' -> ('servelm', 1): a system with its own thread count; 'vllm' -> ('vllm', None)."""
    name, _, threads = spec.partition("@")
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; valid: {', '.join(SYSTEMS)} (optionally @THREADS)")
    return name, int(threads) if threads else None


def _timed(fn, *a) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn(*a)
    return time.perf_counter() - t0, n


def run_task(system, task: str, w: dict) -> dict:
    """`task` is 'warmup' or 'NAME:ROUND' with NAME in offline, decode, prefill."""
    if task == "warmup":  # the batch shapes of the offline run, small, on prompts no round reuses
        system.generate(w["warmup"], 4)
        return {}
    name, _, r = task.partition(":")
    p = w["rounds"][int(r)]
    if name == "offline":
        prompts = p["offline"]
        seconds, produced = _timed(system.generate, prompts, w["output_len"])
        prompt_tokens = sum(len(x) for x in prompts)
        return {
            "seconds": seconds,
            "prompt_tps": prompt_tokens / seconds,
            "output_tps": produced / seconds,
            "total_tps": (prompt_tokens + produced) / seconds,
            "output_tokens": produced,
        }
    if name == "decode":
        one, _ = _timed(system.generate, [p["decode_one"]], 1)
        many, produced = _timed(system.generate, [p["decode_many"]], w["decode_tokens"] + 1)
        return {"decode_ms": 1000 * (many - one) / (produced - 1), "first_token_s": one}
    if name == "prefill":
        seconds, _ = _timed(system.generate, [p["prefill"]], 1)
        return {"prefill_tps": len(p["prefill"]) / seconds}
    raise ValueError(f"unknown task {task!r}")


def worker_main(spec: str, model_dir: str, workload_path: str) -> None:
    w = json.loads(Path(workload_path).read_text())
    name, threads = parse_spec(spec)
    if threads is not None:
        w["threads"] = threads
        if name.startswith("vllm"):  # vLLM's model threads follow its core binding
            w["vllm_omp_bind"] = "0" if threads == 1 else f"0-{threads - 1}"
    started = time.perf_counter()
    system = SYSTEMS[name](model_dir, w)
    print(RESULT_PREFIX + json.dumps({"ready": True, "load_s": time.perf_counter() - started}), flush=True)
    for line in sys.stdin:
        task = line.strip()
        if task == "quit":
            break
        print(RESULT_PREFIX + json.dumps(run_task(system, task, w)), flush=True)


# -- parent: start workers, interleave tasks, report -------------------------------------------


class Worker:
    def __init__(self, name: str, python: str, model_dir: str, workload_path: str, log, source: str | None = None) -> None:
        """`source`: a `src` directory to import servelm from instead of the installed one."""
        self.name = name
        cmd = [python, str(Path(__file__).resolve()), "--worker", name, "--model-dir", model_dir, "--workload", workload_path]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        if source is not None:
            env["PYTHONPATH"] = source
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.log = log
        self.info: dict = {}

    def wait_ready(self) -> None:
        self.info = self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])
            self.log.write(f"[{self.name}] {line}")
            self.log.flush()
        raise RuntimeError(f"{self.name} worker exited (code {self.proc.wait()}); see the log")

    def ask(self, task: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(task + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired):  # a dead pipe, a closed stdin, a hung worker
            self.proc.kill()


def prepare_model_dir(cache_dir: Path) -> tuple[str, int]:
    """The default GGUF exported once as a float32 HF directory (what transformers and vLLM load)."""
    from servelm.models.loader import export_hf_directory, load_checkpoint

    checkpoint = load_checkpoint(None)
    out = cache_dir / "smollm2-135m-instruct-hf"
    if not (out / "model.safetensors").exists():
        export_hf_directory(checkpoint, out)
    return str(out), checkpoint.arch.vocab_size


def parent_main(args: argparse.Namespace) -> None:
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    model_dir, vocab = prepare_model_dir(cache)
    workload = make_workload(args, vocab)
    wpath = cache / "workload.json"
    wpath.write_text(json.dumps(workload))
    log = open(cache / "workers.log", "a")
    systems = [s for s in args.systems.split(",") if s]
    workers: dict[str, Worker] = {}
    skipped: dict[str, str] = {}
    for name in systems:  # all start at once (vLLM takes minutes to start); none measures yet
        parse_spec(name)  # fail early on a typo
        python = str(VLLM_PYTHON) if name.startswith("vllm") else sys.executable
        if name.startswith("vllm") and not VLLM_PYTHON.exists():
            skipped[name] = "no benchmarks/vllm_cpu/.venv (run benchmarks/vllm_cpu/setup.sh)"
            continue
        if name.startswith("baseline") and not args.baseline_src:
            raise SystemExit("the baseline system needs --baseline-src (another checkout's src directory)")
        source = args.baseline_src if name.startswith("baseline") else None
        workers[name] = Worker(name, python, model_dir, str(wpath), log, source)
    for name in list(workers):
        try:
            workers[name].wait_ready()
            workers[name].ask("warmup")
            print(f"{name}: loaded in {workers[name].info['load_s']:.1f}s", flush=True)
        except Exception as exc:  # noqa: BLE001 - a system that cannot run here (any error) is reported, not fatal
            skipped[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name}: skipped ({skipped[name]})", flush=True)
            workers.pop(name).close()
    skip = {tuple(item.split(":", 1)) for item in args.skip.split(",") if item}
    tasks = [t for t in args.tasks.split(",") if t]
    results: dict[str, dict[str, list[dict]]] = {n: {t: [] for t in tasks} for n in workers}
    gemm_gflops: list[float] = []
    try:
        for r in range(args.rounds):
            gemm_gflops.append(measure_matmul_gflops(args.threads))
            print(f"round {r} float32 GEMM of the model's shapes, {args.threads} threads: {gemm_gflops[-1]:.0f} GFLOP/s", flush=True)
            for task in tasks:
                names = list(workers) if r % 2 == 0 else list(reversed(workers))  # alternate who goes first
                for name in names:
                    if (name, task) in skip:
                        continue
                    res = workers[name].ask(f"{task}:{r}")
                    results[name][task].append(res)
                    print(f"round {r} {task:8s} {name:13s} " + " ".join(f"{k}={v:.4g}" for k, v in res.items()), flush=True)
    finally:
        for wk in workers.values():
            wk.close()
    summary = summarise(results, tasks)
    text = render(summary, results, skipped, args, workload, _median(gemm_gflops))
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + text)
    (cache / "last_results.json").write_text(json.dumps({"results": results, "skipped": skipped}, indent=1))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(results: dict, tasks: list[str]) -> dict:
    keys = {"offline": ["prompt_tps", "output_tps", "total_tps"], "decode": ["decode_ms"], "prefill": ["prefill_tps"]}
    summary: dict[str, dict[str, float]] = {}
    for name, per_task in results.items():
        summary[name] = {k: _median([r[k] for r in per_task.get(t, [])]) for t in tasks for k in keys[t]}
    # Round-by-round ratios of each servelm entry to each other system (same round ⇒ same machine load).
    for ours in [n for n in results if n.startswith("servelm")]:
        for other in [n for n in results if not n.startswith("servelm")]:
            for t in tasks:
                for k in keys[t]:
                    pairs = zip(results[ours][t], results[other][t])
                    ratios = [(o[k] / s[k]) if k == "decode_ms" else (s[k] / o[k]) for s, o in pairs]
                    summary[ours][f"x_{other}_{k}"] = _median(ratios)
    return summary


def render(summary: dict, results: dict, skipped: dict, args: argparse.Namespace, w: dict, gemm_gflops: float) -> str:
    n_prompt = sum(len(p) for p in w["rounds"][0]["offline"])
    lines = [
        f"### Run {time.strftime('%Y-%m-%d %H:%M')} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, {args.threads} threads, {args.rounds} rounds)",
        "",
        f"Workload: {args.num_prompts} prompts ({n_prompt} tokens, {args.min_prompt}-{args.max_prompt} each), "
        f"{args.output_len} output tokens each, greedy, ignore_eos. servelm dtype={args.servelm_dtype}, "
        f"max_num_batched_tokens={args.servelm_batched_tokens}; transformers fp32 sdpa batch {args.hf_batch_size}; "
        f"vllm = bfloat16, vllm-fp32 = float32, thread binding {args.vllm_omp_bind or 'auto'}.",
        "",
        f"Compute ceilings: nominal {MATMUL_GFLOPS_FP32:.0f} GFLOP/s (the issue's figure) = "
        f"{MATMUL_GFLOPS_FP32 / GFLOP_PER_TOKEN:.0f} tok/s; measured in this run (float32 GEMM of the model's layer "
        f"shapes, {args.threads} threads, median of rounds) {gemm_gflops:.0f} GFLOP/s = {gemm_gflops / GFLOP_PER_TOKEN:.0f} tok/s.",
        "",
        "| system | prompt tok/s | output tok/s | total tok/s | % of nominal ceiling | % of measured ceiling | decode ms/token | 3k prefill tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    nominal, measured = MATMUL_GFLOPS_FP32 / GFLOP_PER_TOKEN, gemm_gflops / GFLOP_PER_TOKEN
    for name, s in summary.items():
        tot = s.get("total_tps", float("nan"))
        lines.append(
            f"| {name} | {s.get('prompt_tps', float('nan')):.0f} | {s.get('output_tps', float('nan')):.0f} | {tot:.0f} | "
            f"{100 * tot / nominal:.0f}% | {100 * tot / measured:.0f}% | {s.get('decode_ms', float('nan')):.1f} | "
            f"{s.get('prefill_tps', float('nan')):.0f} |"
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} | | | | | | |")
    ratio_lines = [
        f"- {ours} vs {k[2:]}: {v:.2f}x"
        for ours, s in summary.items()
        if ours.startswith("servelm")
        for k, v in s.items()
        if k.startswith("x_")
    ]
    if ratio_lines:
        lines += ["", "Ratios servelm / other (median of per-round ratios; for decode_ms other / servelm: > 1 means servelm is faster):", *ratio_lines]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--systems",
        default="servelm,transformers,vllm,vllm-fp32",
        help="comma-separated; NAME@N runs that system with N threads (vLLM: bound to cores 0..N-1)",
    )
    p.add_argument("--tasks", default="offline,decode,prefill")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip", default="", help="SYSTEM:TASK pairs not to run, e.g. vllm:offline (it takes ~14 min here)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for systems without @N")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--servelm-dtype", default="auto")
    p.add_argument("--baseline-src", help="for the `baseline` system: the src/ of another servelm checkout (e.g. the commit before a change)")
    # vLLM's CPU default token budget per step, so both engines batch alike.
    p.add_argument("--servelm-batched-tokens", type=int, default=4096)
    p.add_argument("--vllm-omp-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND for vLLM (default: its auto)")
    p.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "servelm-offline-bench"))
    p.add_argument("--results", help="append the report (markdown) to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args.worker, args.model_dir, args.workload)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
