"""Batch jobs (issue 43): durability under kill -9, memory at scale, isolation from voice traffic.
Real servers (`servelm serve` subprocesses) over real HTTP; the OpenAI client's lifecycle itself
(upload, create, poll, download, cancel with partial output, expiry) is tests/batch/test_batch_api.py.

    durability  the default model; a 2,000-line batch (completions, prompts of 8-40 words, 16 output
                tokens, greedy); the server is killed with SIGKILL at 10 random points (a number of
                completed lines drawn uniformly) and restarted on the same --data-dir each time.
                Target: the batch completes, every custom_id exactly once, every text equal to the same
                request sent directly (greedy) to the restarted server.
    scale       a 100,000-line input of at least 100 MB (each line's prompt ~1 KB of text, 1 output
                token) through the tiny random model (the default model would take ~2 h of prefill on
                2 cores; the batch machinery, whose memory this measures, is the same). Target: the
                server process's RSS grows at most 100 MB over its idle RSS (sampled every 0.25 s through
                upload, validation, the run, finalizing and the download); the engine core's is reported.
    isolation   the default model at `make serve` defaults. Voice capacity C = voice requests/s at 16 in
                flight (closed loop). Runs, in one sitting: voice alone at 0.6 C (Poisson); a batch of the
                analytics profile's real lengths (documents 500-2,000 tokens, outputs 10-100) alone for a
                window as long; voice at 0.6 C beside that batch. Targets: voice TTFT p90 and TBT p99 beside
                the batch at most 1.1x voice alone; the batch's token throughput beside voice at least 80% of
                the idle capacity, defined here as (1 - 0.6) x the batch's throughput alone.

    PYTHONPATH=src .venv/bin/python benchmarks/batch.py durability|scale|isolation [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from servelm.server.launcher import ServerProcess, launch_server
from servelm.testing.processes import child_pids, kill_hard
from servelm.testing.tiny_model import write_tiny_checkpoint

WORDS = ("the river report quarterly revenue table column growth market customer region north south "
         "product analysis summary figure increase decrease margin forecast budget").split()  # fmt: skip
TERMINAL = ("completed", "failed", "expired", "cancelled")


def _lines(count: int, seed: int, words: tuple[int, int], max_tokens: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))),
                      "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}} for i in range(count)]  # fmt: skip


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    with path.open("w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return path


class Api:
    def __init__(self, server: ServerProcess) -> None:
        self.base = server.base_url
        self.http = httpx.Client(timeout=600)

    def upload(self, path: Path) -> str:
        with path.open("rb") as f:
            reply = self.http.post(f"{self.base}/v1/files", data={"purpose": "batch"}, files={"file": (path.name, f)})
        reply.raise_for_status()
        return reply.json()["id"]

    def create(self, file_id: str) -> str:
        reply = self.http.post(f"{self.base}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                                 "completion_window": "24h"})  # fmt: skip
        reply.raise_for_status()
        return reply.json()["id"]

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self.http.get(f"{self.base}/v1/batches/{batch_id}").json()

    def cancel(self, batch_id: str) -> None:
        self.http.post(f"{self.base}/v1/batches/{batch_id}/cancel")

    def content(self, file_id: str) -> list[dict[str, Any]]:
        with self.http.stream("GET", f"{self.base}/v1/files/{file_id}/content") as reply:
            return [json.loads(line) for line in reply.iter_lines() if line]

    def wait(self, batch_id: str, timeout_s: float = 7200) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while (batch := self.batch(batch_id))["status"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch not done after {timeout_s} s: {batch}")
            time.sleep(0.5)
        return batch


async def _direct_texts(base: str, bodies: list[dict[str, Any]], concurrency: int = 32) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as http:

        async def one(body: dict[str, Any]) -> str:
            async with gate:
                reply = await http.post(f"{base}/v1/completions", json=body)
                return reply.json()["choices"][0]["text"]

        return await asyncio.gather(*(one(b) for b in bodies))


def durability(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="batch-durability-"))
    lines = _lines(args.lines, seed=1, words=(8, 40), max_tokens=16)
    server_args = ["--data-dir", str(work / "data")]
    server = launch_server(None, server_args)
    api = Api(server)
    started = time.monotonic()
    batch_id = api.create(api.upload(_write(work / "in.jsonl", lines)))
    points = sorted(random.Random(args.seed).sample(range(20, args.lines - 20), args.kills))
    kills = []
    try:
        for point in points:
            while (done := api.batch(batch_id)["request_counts"]["completed"]) < point:
                time.sleep(0.02)
            kill_hard(server.process)
            restart = time.monotonic()
            server = launch_server(None, server_args)
            api = Api(server)
            after = api.batch(batch_id)["request_counts"]["completed"]
            kills.append({"at_completed": done, "completed_after_restart": after,
                          "restart_s": round(time.monotonic() - restart, 2)})  # fmt: skip
            print(f"killed at {done} completed; {after} after the restart", flush=True)
        batch = api.wait(batch_id)
        elapsed = time.monotonic() - started
        outputs = api.content(batch["output_file_id"]) if batch.get("output_file_id") else []
        ids = [o["custom_id"] for o in outputs]
        direct = asyncio.run(_direct_texts(server.base_url, [line["body"] for line in lines]))
        texts = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"] for o in outputs}
        mismatches = [line["custom_id"] for line, text in zip(lines, direct, strict=True) if texts.get(line["custom_id"]) != text]
    finally:
        server.stop()
    result = {
        "lines": args.lines, "kills": kills, "status": batch["status"], "request_counts": batch["request_counts"],
        "each_custom_id_once": ids == [line["custom_id"] for line in lines], "duplicates": len(ids) - len(set(ids)),
        "missing": len({line["custom_id"] for line in lines} - set(ids)), "text_mismatches": len(mismatches),
        "elapsed_s": round(elapsed, 1),
    }  # fmt: skip
    result["met"] = (batch["status"] == "completed" and result["each_custom_id_once"] and not mismatches
                     and all(k["completed_after_restart"] >= k["at_completed"] for k in kills))  # fmt: skip
    return result


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class RssSampler(threading.Thread):
    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval_s = pids, interval_s
        self.peak = {name: 0.0 for name in pids}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], _rss_mb(pid))
            time.sleep(self.interval_s)

    def stop(self) -> dict[str, float]:
        self._stop_event.set()
        self.join()
        return self.peak


def scale(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="batch-scale-"))
    model = write_tiny_checkpoint(work / "tiny", seed=0)
    rng = random.Random(2)
    source = work / "in.jsonl"
    with source.open("w") as f:
        for i in range(args.lines):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 190)))  # ~1 KB
            f.write(json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": prompt, "max_tokens": 1, "temperature": 0}}) + "\n")  # fmt: skip
    size_mb = source.stat().st_size / 2**20
    server = launch_server(model, ["--data-dir", str(work / "data"), "--max-num-seqs", "256"])
    try:
        api = Api(server)
        for _ in range(8):  # warm: the routes, the tokenizer, the engine's first steps
            api.http.post(f"{server.base_url}/v1/completions", json={"prompt": "warm up " * 100, "max_tokens": 1})
        time.sleep(2)
        [core] = child_pids(server.process.pid, "spawn_main") or [0]
        idle = {"server": _rss_mb(server.process.pid), "core": _rss_mb(core)}
        sampler = RssSampler({"server": server.process.pid, "core": core})
        sampler.start()
        started = time.monotonic()
        batch_id = api.create(api.upload(source))
        batch = api.wait(batch_id)
        run_s = time.monotonic() - started
        outputs = sum(1 for _ in api.content(batch["output_file_id"])) if batch.get("output_file_id") else 0
        peak = sampler.stop()
    finally:
        server.stop()
    growth = peak["server"] - idle["server"]
    return {"lines": args.lines, "input_mb": round(size_mb, 1), "status": batch["status"],
            "request_counts": batch["request_counts"], "output_lines": outputs, "run_s": round(run_s, 1),
            "lines_per_s": round(args.lines / run_s, 1), "idle_rss_mb": {k: round(v, 1) for k, v in idle.items()},
            "peak_rss_mb": {k: round(v, 1) for k, v in peak.items()}, "server_rss_growth_mb": round(growth, 1),
            "core_rss_growth_mb": round(peak["core"] - idle["core"], 1),
            "met": batch["status"] == "completed" and size_mb >= 100 and growth <= 100}  # fmt: skip


def _bench(server: ServerProcess, out: Path, *load: str, requests: int, seed: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "servelm.cli", "bench", "run", "--base-url", server.base_url, "--profile", "voice",
               "--num-requests", str(requests), "--seed", str(seed), "--out", str(out), "--no-progress", "--no-plots",
               *load]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "run.json").read_text())["summary"]
    overall = summary["overall"]
    return {"ttft_p90_s": overall["ttft_s"]["p90"], "tbt_p99_s": overall["tbt_s"]["p99"],
            "req_s": overall["request_throughput"], "duration_s": summary["duration_s"]}  # fmt: skip


def _step_buckets(server: ServerProcess) -> dict[float, float]:
    """The server's servelm:engine_step_seconds histogram: cumulative count per bucket bound."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics", timeout=30).text):
        if family.name == "servelm:engine_step_seconds":
            counts.update((float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket"))
    return counts


def _steps_over(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """Of the steps run between two scrapes, the share longer than 25, 50, 75 and 100 ms (why a
    token gap grew: the engine's steps, or the way out of it)."""
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    return {f"over_{round(le * 1000)}ms": round(1 - (after[le] - before.get(le, 0.0)) / total, 4) if total else 0.0
            for le in (0.025, 0.05, 0.075, 0.1)} | {"steps": total}  # fmt: skip


def _analytics_lines(count: int, seed: int) -> tuple[list[dict[str, Any]], float]:
    """The analytics profile's real lengths as token-id prompts; returns the lines and the mean tokens per line."""
    rng = random.Random(seed)
    lines, tokens = [], 0
    for i in range(count):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(500, 2000))]
        max_tokens = rng.randint(10, 100)
        tokens += len(prompt) + max_tokens
        lines.append({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})  # fmt: skip
    return lines, tokens / count


def _batch_window(api: Api, batch_id: str, seconds: float | None, during: Any = None) -> tuple[float, float]:
    """(lines completed, seconds) over `seconds` of waiting, or over `during()`'s run."""
    while api.batch(batch_id)["request_counts"]["completed"] < 1:  # running: past validation and the first line
        time.sleep(0.2)
    before, started = api.batch(batch_id)["request_counts"]["completed"], time.monotonic()
    if during is not None:
        during()
    else:
        time.sleep(seconds or 0)
    after = api.batch(batch_id)["request_counts"]["completed"]
    return after - before, time.monotonic() - started


def isolation(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="batch-isolation-"))
    server = launch_server(None, ["--data-dir", str(work / "data")])
    try:
        api = Api(server)
        if args.voice_rate:  # a rate fixed across runs (to compare two commits), capacity not measured
            capacity = args.voice_rate / 0.6
        else:
            capacity = _bench(server, work / "capacity", "--concurrency", "16", requests=args.voice_requests,
                              seed=3)["req_s"]  # fmt: skip
        rate = 0.6 * capacity
        before = _step_buckets(server)
        voice_alone = _bench(server, work / "voice-alone", "--rate", f"{rate:.3f}", requests=args.voice_requests, seed=4)
        voice_alone["engine_steps"] = _steps_over(before, _step_buckets(server))
        window = voice_alone["duration_s"] or 60.0
        lines, tokens_per_line = _analytics_lines(args.batch_lines, seed=5)
        path = _write(work / "analytics.jsonl", lines)
        alone_id = api.create(api.upload(path))
        alone_lines, alone_s = _batch_window(api, alone_id, window)
        api.cancel(alone_id)
        api.wait(alone_id)
        beside_id = api.create(api.upload(path))
        voice_beside: dict[str, Any] = {}

        def voice() -> None:
            before = _step_buckets(server)
            voice_beside.update(_bench(server, work / "voice-beside", "--rate", f"{rate:.3f}",
                                       requests=args.voice_requests, seed=4))  # fmt: skip
            voice_beside["engine_steps"] = _steps_over(before, _step_buckets(server))

        beside_lines, beside_s = _batch_window(api, beside_id, None, during=voice)
        api.cancel(beside_id)
        api.wait(beside_id)
    finally:
        server.stop()
    alone_tps = alone_lines * tokens_per_line / alone_s
    beside_tps = beside_lines * tokens_per_line / beside_s
    idle_capacity = (1 - 0.6) * alone_tps
    ttft_ratio = voice_beside["ttft_p90_s"] / voice_alone["ttft_p90_s"]
    tbt_ratio = voice_beside["tbt_p99_s"] / voice_alone["tbt_p99_s"]
    used = beside_tps / idle_capacity if idle_capacity else 0.0
    return {"voice_capacity_req_s": round(capacity, 3), "voice_rate_req_s": round(rate, 3), "voice_alone": voice_alone,
            "voice_beside_batch": voice_beside, "ttft_p90_ratio": round(ttft_ratio, 3), "tbt_p99_ratio": round(tbt_ratio, 3),
            "batch_alone_tokens_per_s": round(alone_tps, 1), "batch_beside_voice_tokens_per_s": round(beside_tps, 1),
            "idle_capacity_used": round(used, 3), "batch_lines": {"alone": alone_lines, "beside": beside_lines},
            "met": ttft_ratio <= 1.1 and tbt_ratio <= 1.1 and used >= 0.8}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["durability", "scale", "isolation"])
    parser.add_argument("--lines", type=int, default=None, help="durability: 2,000; scale: 100,000")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--voice-requests", type=int, default=120)
    parser.add_argument("--batch-lines", type=int, default=1000)
    parser.add_argument("--voice-rate", type=float, default=None,
                        help="isolation: voice at this rate instead of 60%% of a capacity measured first (the same "
                             "load for two commits; the capacity moved 1.34-1.72 req/s between sittings)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here too")
    args = parser.parse_args()
    args.lines = args.lines or {"durability": 2000, "scale": 100_000}.get(args.which, 0)
    result = {"durability": durability, "scale": scale, "isolation": isolation}[args.which](args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
