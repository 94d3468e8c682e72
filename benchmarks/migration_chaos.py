"""Chaos through the router (issue 17): steady streaming load while faults hit the replicas serving it.

    C clients (closed loop: greedy streams of --tokens tokens, ignore_eos, return_token_ids)
        ─▶ servelm router ─▶ CutProxy i ─▶ servelm serve i          (tiny model by default, N replicas)

Every --fault-interval s (x0.5-1.5 at random), one fault on a replica with streams in flight:
    cut   its router connections are reset (the process is untouched)
    kill  SIGKILL of its process; it is started again on its port in the background
    core  SIGKILL of its engine core; a replica not serving again within --core-grace s (no engine-core
          supervision) has its process restarted as for kill
A kill or core fault that would leave fewer than 2 replicas serving becomes a cut.

Each stream is compared with the undisturbed run of its prompt (measured first, without faults): the same
token ids (greedy) is `exact`, a completed stream with other ids is `wrong` (a duplicated, missing or
different token), anything else `failed` (an error event, no [DONE], an HTTP error). `migrated` is the
router's servelm:router_migrations_total; the added latency of a migration is the router's
servelm:router_migration_seconds (its replica failed → the next replica's first event at the client,
the continuation's prefill included), and per stream the largest gap between two events. After the load:
each replica's KV blocks in use (baseline 0) and every process's RSS.

    .venv/bin/python benchmarks/migration_chaos.py                        # defaults: see --help
    .venv/bin/python benchmarks/migration_chaos.py --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from servelm.testing.proxied_fleet import ProxiedFleet, start_proxied_fleet
from servelm.testing.tiny_model import write_tiny_checkpoint

FAULTS = ("cut", "kill", "core")


@dataclass
class Outcome:
    kind: str  # exact | wrong_ids | wrong_text | failed
    duration_s: float
    max_gap_s: float
    gap_at_s: float  # since the load began
    detail: str = ""


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)
    restarts: int = 0
    router_rss_before_mb: float = 0.0  # after the undisturbed runs, before the load


@dataclass
class Streamed:
    ids: list[int] | None  # None: the stream did not complete
    text: str
    max_gap_s: float  # the largest gap between two events (the first: from the request)
    gap_at_s: float  # when that gap ended (monotonic)
    why: str = ""  # why it did not complete


async def stream_ids(client: httpx.AsyncClient, url: str, body: dict) -> Streamed:
    ids: list[int] = []
    text, gap, gap_at, last, done, error = "", 0.0, 0.0, time.monotonic(), False, ""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Streamed(None, "", 0.0, 0.0, f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                if now - last > gap:
                    gap, gap_at = now - last, now
                last = now
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                for choice in chunk.get("choices", []):
                    ids += choice.get("token_ids", [])
                    text += choice.get("text", "")
    except httpx.HTTPError as exc:
        return Streamed(None, text, gap, gap_at, f"{type(exc).__name__}: {exc}")
    if error or not done:
        return Streamed(None, text, gap, gap_at, error or "no [DONE]")
    return Streamed(ids, text, gap, gap_at)


def body_for(prompt: str, tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip


async def load(fleet: ProxiedFleet, prompts: list[str], reference: dict[str, Streamed], args: argparse.Namespace,
               run: Run, start: float, end: float, rng: random.Random) -> None:  # fmt: skip
    async def one_client() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, read=60)) as client:
            while time.monotonic() < end:
                prompt = rng.choice(prompts)
                started = time.monotonic()
                got, want = await stream_ids(client, fleet.router, body_for(prompt, args.tokens)), reference[prompt]
                kind, why = "exact", got.why
                if got.ids is None:
                    kind = "failed"
                elif got.ids != want.ids:
                    kind, why = "wrong_ids", f"{len(got.ids)} ids, first difference at {_first_difference(got.ids, want.ids or [])}"
                elif got.text != want.text:
                    kind, why = "wrong_text", f"text {got.text!r} != {want.text!r}"
                run.outcomes.append(Outcome(kind, time.monotonic() - started, got.max_gap_s, got.gap_at_s - start, why))

    await asyncio.gather(*(one_client() for _ in range(args.concurrency)))


def _first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


async def faults(fleet: ProxiedFleet, args: argparse.Namespace, run: Run, end: float, rng: random.Random) -> None:
    recovering: dict[int, asyncio.Task] = {}

    async def restart(index: int, after_s: float) -> None:
        if after_s and await asyncio.to_thread(_serves_within, fleet, index, after_s):
            return  # it recovered by itself (engine-core supervision)
        await asyncio.to_thread(fleet.restart, index)
        run.restarts += 1

    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < end:
            await asyncio.sleep(args.fault_interval * rng.uniform(0.5, 1.5))
            replicas = (await client.get(f"{fleet.router}/admin/replicas")).json()["replicas"]
            healthy = {fleet.index_of(r["url"]): r for r in replicas if r["healthy"]}
            serving = sorted(set(healthy) - {i for i, task in recovering.items() if not task.done()})
            busy = [i for i in serving if healthy[i]["in_flight"] > 0]
            if not busy:
                continue
            index, kind = rng.choice(busy), rng.choice(args.faults)
            if kind != "cut" and len(serving) < 3:  # it must leave 2 serving
                kind = "cut"
            run.faults[kind] += 1
            if kind == "cut":
                fleet.proxies[index].cut()
            elif kind == "kill":
                fleet.replicas[index].process.kill()
                recovering[index] = asyncio.create_task(restart(index, 0.0))
            else:
                fleet.kill_engine_core(index)
                recovering[index] = asyncio.create_task(restart(index, args.core_grace))
    await asyncio.gather(*recovering.values())


def _serves_within(fleet: ProxiedFleet, index: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    time.sleep(1.0)  # the API process notices the dead core first
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{fleet.replicas[index].base_url}/ready", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def replica_metric(fleet: ProxiedFleet, index: int, name: str) -> float:
    text = httpx.get(f"{fleet.replicas[index].base_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def histogram_quantile(fleet: ProxiedFleet, name: str, q: float) -> float:
    """A quantile of a router histogram from its cumulative buckets (the bucket's upper bound)."""
    text = httpx.get(f"{fleet.router}/metrics", timeout=10).text
    buckets = sorted((float(line.split('le="')[1].split('"')[0]), float(line.rsplit(" ", 1)[1]))
                     for line in text.splitlines() if line.startswith(name + "_bucket"))  # fmt: skip
    total = buckets[-1][1] if buckets else 0.0
    return next((bound for bound, count in buckets if total and count >= q * total), float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: a tiny random Llama)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load under faults")
    parser.add_argument("--fault-interval", type=float, default=4.0)
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"a comma list of {', '.join(FAULTS)}")
    parser.add_argument("--core-grace", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=None, help="append a section to this RESULTS.md")
    args = parser.parse_args()
    args.faults = [f for f in args.faults.split(",") if f]
    rng = random.Random(args.seed)
    model = Path(args.model) if args.model else write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "model", seed=0)
    replica_args = ["--num-blocks", "2048", "--num-threads", "1", "--max-num-seqs", "32"]
    router_args = ["--policy", "least_load", "--health-interval", "0.5"]
    fleet = start_proxied_fleet(model, args.replicas, replica_args, router_args)
    try:
        prompts = [f"Chapter {i}: the {rng.choice(['red', 'old', 'quiet', 'far'])} harbour at night, and" for i in
                   range(args.prompts)]  # fmt: skip
        reference = asyncio.run(_references(fleet, prompts, args.tokens))
        before = {name: fleet.metric(name) for name in ("servelm:router_migrations_total",
                  "servelm:router_migration_failures_total", "servelm:router_retries_total")}  # fmt: skip
        run = Run(router_rss_before_mb=rss_mb(fleet.router_process.pid))
        started = time.monotonic()
        end = started + args.duration

        async def chaos() -> None:
            await asyncio.gather(load(fleet, prompts, reference, args, run, started, end, rng),
                                 faults(fleet, args, run, end, rng))  # fmt: skip

        asyncio.run(chaos())
        wall = time.monotonic() - started
        fleet.wait_healthy(timeout_s=120)
        time.sleep(2.0)
        counts = {name: fleet.metric(name) - value for name, value in before.items()}
        report = _report(fleet, args, run, wall, counts)
    finally:
        fleet.close()
    print(report)
    if args.results is not None:
        with args.results.open("a") as f:
            f.write("\n" + report)


async def _references(fleet: ProxiedFleet, prompts: list[str], tokens: int) -> dict[str, Streamed]:
    async with httpx.AsyncClient(timeout=120) as client:
        results = await asyncio.gather(*(stream_ids(client, fleet.router, body_for(p, tokens)) for p in prompts))
    for prompt, result in zip(prompts, results):
        if result.ids is None or len(result.ids) != tokens:
            raise RuntimeError(f"the undisturbed run of {prompt!r} failed: {result.why}")
    return dict(zip(prompts, results))


def _report(fleet: ProxiedFleet, args: argparse.Namespace, run: Run, wall: float, counts: dict[str, float]) -> str:
    kinds = Counter(o.kind for o in run.outcomes)
    gaps = sorted(o.max_gap_s for o in run.outcomes)
    kv = [replica_metric(fleet, i, "servelm:kv_cache_used_blocks") for i in range(len(fleet.replicas))]
    rss = [rss_mb(fleet.router_process.pid)] + [rss_mb(r.process.pid) for r in fleet.replicas]
    problems = [o.detail for o in run.outcomes if o.kind != "exact"][:5]
    slow = sorted((o for o in run.outcomes if o.max_gap_s > 2.0), key=lambda o: -o.max_gap_s)[:5]
    problems += [f"a {o.max_gap_s:.1f} s gap ending at +{o.gap_at_s:.1f} s" for o in slow]
    joins = fleet.router_log.read_text(errors="replace").count("could not join the texts")
    p50 = histogram_quantile(fleet, "servelm:router_migration_seconds", 0.5)
    p99 = histogram_quantile(fleet, "servelm:router_migration_seconds", 0.99)
    total, count = fleet.metric("servelm:router_migration_seconds_sum"), fleet.metric("servelm:router_migration_seconds_count")
    mean = total / count if count else float("nan")
    lines = [
        f"## Migration under chaos (issue 17): {datetime.date.today().isoformat()}",
        "",
        f"{args.replicas} replicas ({args.model or 'tiny random Llama'}, 1 thread each) behind `servelm router`, "
        f"each behind a TCP proxy; {args.concurrency} closed-loop clients, greedy streams of {args.tokens} tokens "
        f"over {args.prompts} prompts, {wall:.0f} s; a fault every ~{args.fault_interval:g} s on a replica with "
        f"streams in flight ({', '.join(f'{k} {v}' for k, v in sorted(run.faults.items()))}; {run.restarts} "
        "restarts).",
        "",
        "    .venv/bin/python benchmarks/migration_chaos.py " + " ".join(
            f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ','.join(v)}" for k, v in
            (("replicas", args.replicas), ("concurrency", args.concurrency), ("tokens", args.tokens),
             ("duration", args.duration), ("fault_interval", args.fault_interval), ("faults", args.faults))),
        "",
        "| sent | completed exact | wrong ids | wrong text | failed | migrated | migration failures | retries "
        "(before a byte) | inexact joins |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {len(run.outcomes)} | {kinds['exact']} | {kinds['wrong_ids']} | {kinds['wrong_text']} | {kinds['failed']} | "
        f"{counts['servelm:router_migrations_total']:.0f} | {counts['servelm:router_migration_failures_total']:.0f} | "
        f"{counts['servelm:router_retries_total']:.0f} | {joins} |",
        "",
        f"Added latency per migration (router, failure → next replica's first event): mean {mean * 1000:.0f} ms, "
        f"p50 <= {p50 * 1000:.0f} ms, p99 <= {p99 * 1000:.0f} ms (histogram bucket bounds). Largest gap between "
        f"two events per stream: p50 {statistics.median(gaps) * 1000:.0f} ms, p99 "
        f"{gaps[int(0.99 * (len(gaps) - 1))] * 1000:.0f} ms, max {gaps[-1] * 1000:.0f} ms. Stream duration p50 "
        f"{statistics.median(o.duration_s for o in run.outcomes):.2f} s.",
        "",
        f"After the load: KV blocks in use per replica {', '.join(f'{b:.0f}' for b in kv)} (baseline 0); RSS MB "
        f"router {rss[0]:.0f} (before the load {run.router_rss_before_mb:.0f}), replicas "
        f"{', '.join(f'{m:.0f}' for m in rss[1:])} (API processes).",
    ]
    if problems:
        lines += ["", "Problems (first five of each kind): " + "; ".join(problems)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
