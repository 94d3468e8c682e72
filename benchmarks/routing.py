"""Routing policies compared on a multi-tenant workload: round_robin, least_load, prefix, kv.

    client (Poisson arrivals, streaming) ──▶ servelm router --policy P ──▶ 2 x servelm serve
                                                                            (default model, 1 thread each,
                                                                             --kv-events-port for kv)

Workload (issue 6): `--tenants` tenants, each with its own system prompt of
`--system-tokens` tokens (uniform in the range), and many short questions: each request is
one tenant's system prompt + a fresh `--question-tokens` question, tenants interleaved at
random. Prompts are built from token ids (servelm.bench.tokens), so the token counts and the
shared prefixes are exact.

Cold cache per policy without restarting the replicas (a restart costs ~1 min here): every
policy gets its own freshly sampled tenants, so no block it could hit was ever computed
before it ran (the previous policies' blocks only occupy LRU space, as stale entries do in
production). The router is restarted per policy (its indexes start empty). The same arrival
times and prompt lengths are used for every policy.

Measured per policy:
- prefix-cache hit rate: the replicas' own counters (servelm:prefix_cache_hits / _queries,
  summed over replicas, before/after), and its ratio to the ideal rate: every tenant's
  system prompt computed exactly once in the whole fleet (full blocks only);
- TTFT p50 / p99 (request sent → first streamed token) and throughput (output tokens/s,
  requests/s) at the client.

    .venv/bin/python benchmarks/routing.py                          # defaults: see --help
    .venv/bin/python benchmarks/routing.py --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from servelm.bench.tokens import TokenSource, load_token_source
from servelm.ports import free_port_range
from servelm.server.launcher import ServerProcess, launch_server, wait_until_ready

BLOCK_SIZE = 16
POLICIES = ("round_robin", "least_load", "prefix", "kv")


@dataclass
class Request:
    tenant: int
    arrival_s: float
    prompt: str
    num_prompt_tokens: int
    num_shared_tokens: int  # tokens of the tenant's system prompt at the start of this prompt (BOS included)


@dataclass
class Result:
    policy: str
    ttft_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_failed: int = 0
    wall_s: float = 0.0
    hit_tokens: float = 0.0
    queried_tokens: float = 0.0
    ideal_hit_rate: float = 0.0
    per_replica_requests: dict[str, int] = field(default_factory=dict)  # routed by the router (retries included)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def ttft_ms(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        ordered = sorted(self.ttft_s)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def build_workload(tokens: TokenSource, args: argparse.Namespace, seed: int, arrivals: list[float],
                   tenant_of: list[int], question_lengths: list[int]) -> list[Request]:  # fmt: skip
    """Fresh tenants (system prompts) for this seed; arrival times, tenant order and lengths shared by all policies."""
    rng = random.Random(seed)
    low, high = args.system_tokens
    length_rng = random.Random(args.seed)  # same system prompt lengths for every policy
    systems = [tokens.sample(rng, length_rng.randint(low, high)) for _ in range(args.tenants)]
    requests = []
    for arrival, tenant, question_length in zip(arrivals, tenant_of, question_lengths):
        ids = systems[tenant] + tokens.sample(rng, question_length)
        requests.append(Request(tenant, arrival, tokens.exact_text(ids), len(ids) + tokens.num_special_tokens,
                                len(systems[tenant]) + tokens.num_special_tokens))  # fmt: skip
    return requests


def ideal_hit_rate(requests: list[Request]) -> float:
    """Every tenant's system prompt computed once in the fleet; every later request hits its full blocks.

    The engine never serves a prompt's last token from cache (it needs its logits), hence the cap.
    """
    seen: set[int] = set()
    hits = 0
    for request in requests:
        if request.tenant in seen:
            cacheable = min(request.num_shared_tokens, request.num_prompt_tokens - 1)
            hits += cacheable // BLOCK_SIZE * BLOCK_SIZE
        seen.add(request.tenant)
    return hits / sum(r.num_prompt_tokens for r in requests)


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for name in names:
            if line.startswith((name + "{", name + " ")):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


def cache_counters(replicas: list[ServerProcess]) -> tuple[float, float]:
    names = ("servelm:prefix_cache_hits_total", "servelm:prefix_cache_queries_total")
    hits = queries = 0.0
    for replica in replicas:
        values = scrape(replica.base_url, names)
        hits += values[names[0]]
        queries += values[names[1]]
    return hits, queries


async def send(client: httpx.AsyncClient, url: str, request: Request, max_tokens: int, start: float, result: Result) -> None:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    body = {"prompt": request.prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    sent = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.num_failed += 1
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = first or time.perf_counter()
                    result.num_output_tokens += 1  # one token per chunk at temperature 0 with no stop strings
    except httpx.HTTPError:
        result.num_failed += 1
        return
    if first is not None:
        result.ttft_s.append(first - sent)


def start_router(policy: str, port: int, replicas: list[ServerProcess], kv_ports: list[int], model: str | None,
                 log_dir: Path) -> subprocess.Popen:  # fmt: skip
    command = [sys.executable, "-m", "servelm.cli", "router", "--port", str(port), "--policy", policy]
    command += ["--model", model] if model else []
    for replica, kv_port in zip(replicas, kv_ports):
        command += ["--replica", f"{replica.base_url},kv=tcp://127.0.0.1:{kv_port}"]
    with open(log_dir / f"router-{policy}.log", "wb") as log:  # the child keeps its own copy of the fd
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(process, f"http://127.0.0.1:{port}/ready", 120)
    except RuntimeError as exc:
        process.kill()
        raise RuntimeError(f"router ({policy}) {exc}: see {log_dir}") from None
    return process


def wait_idle(replicas: list[ServerProcess], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    names = ("servelm:num_requests_running", "servelm:num_requests_waiting")
    while time.monotonic() < deadline:
        if all(sum(scrape(r.base_url, names).values()) == 0 for r in replicas):
            return
        time.sleep(0.5)


def run_policy(policy: str, requests: list[Request], replicas: list[ServerProcess], kv_ports: list[int],
               args: argparse.Namespace, log_dir: Path) -> Result:  # fmt: skip
    port = free_port_range(1)
    router = start_router(policy, port, replicas, kv_ports, args.model, log_dir)
    result = Result(policy, ideal_hit_rate=ideal_hit_rate(requests))
    try:
        hits0, queries0 = cache_counters(replicas)
        url = f"http://127.0.0.1:{port}"

        async def run() -> None:
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
            async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
                start = time.perf_counter()
                await asyncio.gather(*(send(client, url, r, args.max_tokens, start, result) for r in requests))
                result.wall_s = time.perf_counter() - start

        asyncio.run(run())
        wait_idle(replicas)
        hits1, queries1 = cache_counters(replicas)
        result.hit_tokens, result.queried_tokens = hits1 - hits0, queries1 - queries0
        replicas_seen = httpx.get(f"{url}/admin/replicas", timeout=30).json()["replicas"]
        result.per_replica_requests = {r["url"]: r["num_requests"] for r in replicas_seen}
    finally:
        router.terminate()
        router.wait(30)
    return result


def report(results: list[Result], args: argparse.Namespace, num_requests: int) -> str:
    base = next((r for r in results if r.policy == "round_robin"), None)
    lines = [
        "| policy | hit rate | ideal | of ideal | TTFT p50 ms | TTFT p99 ms | p50 vs round_robin | out tok/s | req/s | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        speedup = base.ttft_ms(0.5) / r.ttft_ms(0.5) if base is not None else float("nan")
        lines.append(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.ideal_hit_rate:.1%} | {r.hit_rate / r.ideal_hit_rate:.0%} "
            f"| {r.ttft_ms(0.5):.0f} | {r.ttft_ms(0.99):.0f} | {speedup:.2f}x "
            f"| {r.num_output_tokens / r.wall_s:.1f} | {len(r.ttft_s) / r.wall_s:.2f} | {r.num_failed} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=(200, 400),
                        help="min,max tokens of a tenant's system prompt")  # fmt: skip
    parser.add_argument("--question-tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=(10, 30))
    parser.add_argument("--requests", type=int, default=40, help="per policy")
    parser.add_argument("--rate", type=float, default=0.4, help="requests/s, Poisson arrivals")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=112, help="KV blocks per replica (16 tokens each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default=None, help="append the section to this markdown file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    tokens = load_token_source(args.model)
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    tenant_of = [rng.randrange(args.tenants) for _ in range(args.requests)]
    question_lengths = [rng.randint(*args.question_tokens) for _ in range(args.requests)]
    log_dir = Path(tempfile.mkdtemp(prefix="servelm-routing-bench-"))
    base = free_port_range(4)
    kv_ports = [base, base + 2]
    replica_args = ["--num-threads", "1", "--num-blocks", str(args.num_blocks), "--block-size", str(BLOCK_SIZE)]
    print(f"starting 2 replicas (logs and router logs in {log_dir}) ...", flush=True)
    with ThreadPoolExecutor(2) as pool:
        replicas = list(pool.map(lambda kv: launch_server(args.model, replica_args + ["--kv-events-port", str(kv)]), kv_ports))
    results = []
    try:
        for index, policy in enumerate(policies):
            requests = build_workload(tokens, args, args.seed * 1000 + index + 1, arrivals, tenant_of, question_lengths)
            print(f"{policy}: {len(requests)} requests ...", flush=True)
            result = run_policy(policy, requests, replicas, kv_ports, args, log_dir)
            results.append(result)
            print(f"  hit rate {result.hit_rate:.1%} (ideal {result.ideal_hit_rate:.1%}), "
                  f"TTFT p50 {result.ttft_ms(0.5):.0f} ms p99 {result.ttft_ms(0.99):.0f} ms, "
                  f"{result.wall_s:.0f} s, failed {result.num_failed}, per replica {result.per_replica_requests}", flush=True)  # fmt: skip
    finally:
        for replica in replicas:
            replica.stop()
    table = report(results, args, args.requests)
    print(table)
    if args.results:
        append_results(Path(args.results), table, args, argv)
    return 0


def append_results(path: Path, table: str, args: argparse.Namespace, argv: list[str] | None) -> None:
    command = " ".join(["benchmarks/routing.py", *(argv if argv is not None else sys.argv[1:])])
    section = f"""
## Routing policies (issue 6)

Date {datetime.date.today().isoformat()}. Machine: 2 CPU cores (shared with other
jobs), no GPU. Two `servelm serve` replicas of the default model (SmolLM2-135M-Instruct Q4_1), one torch
thread each, {args.num_blocks} KV blocks of {BLOCK_SIZE} tokens per replica; `servelm router` per policy.

Workload: {args.tenants} tenants, system prompts of {args.system_tokens[0]}-{args.system_tokens[1]} tokens
(reduced from the issue's 1-2k: a 2k-token prefill takes seconds on one CPU thread), questions of
{args.question_tokens[0]}-{args.question_tokens[1]} tokens, {args.requests} streamed requests per policy, Poisson
arrivals at {args.rate} req/s, {args.max_tokens} output tokens each. Fresh tenants per policy (cold cache), same
arrival times and lengths. Hit rate from the replicas' prefix-cache counters; "ideal" = each system prompt
computed once in the fleet.

    .venv/bin/python {command}

{table}
"""
    if not path.exists():
        path.write_text("# Benchmark results\n")
    with path.open("a") as out:
        out.write(section)


if __name__ == "__main__":
    sys.exit(main())
