"""What the HTTP API adds to TTFT and TBT: the same workload through `servelm serve` and straight
into the engine, in one run.

    ids:   this process ── AsyncEngineClient ──ZMQ──▶ engine core      (token ids in and out)
    text:  this process (tokenize, detokenize) ── AsyncEngineClient ──ZMQ──▶ engine core
    http:  this process ── HTTP/SSE ──▶ servelm serve ── AsyncEngineClient ──ZMQ──▶ engine core
           (text in: validation, tokenization, detokenization, SSE framing, the client's parsing)

`text` does what any caller of the engine with text must do, with the server's own tokenizer and
detokenizer objects, so http − text is what HTTP, FastAPI and SSE add; http − ids is everything
the serving stack adds, tokenization included. All engines are identical (same flags, one torch
thread each) and never run at the same time: the paths take turns within each round, in an order
that reverses every round, so drift in machine load hits all. Each round is a closed loop of
`--concurrency` workers, each sending `--requests-per-worker` requests back to back, with fresh
random prompts (no prefix-cache hits across rounds); HTTP clients hold keep-alive connections
opened before the clock starts. TTFT: request sent → first token (text, for text and http)
received. TBT: the gaps between a request's successive token arrivals. Targets (issue 4): the API
may add at most 5 ms to median TTFT and 1 ms to median TBT at 32 concurrent streams.

    .venv/bin/python benchmarks/serving_overhead.py                     # tiny random model
    .venv/bin/python benchmarks/serving_overhead.py --model /path/to/hf-or-gguf --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.async_client import AsyncEngineClient
from servelm.engine.output_state import RequestState
from servelm.obs.attribution import attribute_ttft
from servelm.sampling_params import SamplingParams
from servelm.server.launcher import launch_server
from servelm.tokenization.prompt_tokenizer import PromptTokenizer

TTFT_BUDGET_MS, TBT_BUDGET_MS = 5.0, 1.0


@dataclass
class Samples:
    ttft_ms: list[float] = field(default_factory=list)
    tbt_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    breakdowns: list[dict[str, float]] = field(default_factory=list)  # TTFT split: the server's (http), from core events (direct)
    api_cpu_s: float = 0.0  # CPU time the API server process spent (http only)
    streamed_tokens: int = 0  # every token the API streamed, ramp-up included (what api_cpu_s paid for)
    round_medians: list[tuple[float, float]] = field(default_factory=list)  # (TTFT p50, TBT p50) of each round

    def add_round(self, other: Samples) -> None:
        self.ttft_ms += other.ttft_ms
        self.tbt_ms += other.tbt_ms
        self.tokens += other.tokens
        self.breakdowns += other.breakdowns
        self.api_cpu_s += other.api_cpu_s
        self.streamed_tokens += other.streamed_tokens
        self.round_medians.append((statistics.median(other.ttft_ms), statistics.median(other.tbt_ms)))


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc): what it took from the machine, whatever the load."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Direct child processes of `pid` (Linux /proc)."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(child) for child in f.read().split()]
    return found


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process (torch and ZMQ threads included) to `cpus`."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)


def _pin_engines(engine_pids: list[int], other_pids: list[int]) -> str:
    """Engine cores on CPU 0, everything else (API server, this client) on the other CPUs: then
    neither path's engine competes with the API or the client, and the gap is the API's own."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "not pinned: one CPU"
    engine_cpu, rest = {cpus[0]}, set(cpus[1:])
    for pid in engine_pids:
        _pin(pid, engine_cpu)
    for pid in other_pids:
        _pin(pid, rest)
    return f"engine cores pinned to CPU {cpus[0]}; API server and client to CPUs {sorted(rest)}"


def _output_lengths(rng: random.Random, count: int, args) -> list[int]:
    """max_tokens per request, uniform over max_tokens × [1 − spread, 1 + spread]. With spread 0 every
    stream of a round ends in the same step and the next 32 requests arrive as one burst (a
    synchronised closed loop); real streams end at different times."""
    low = max(1, round(args.max_tokens * (1 - args.max_tokens_spread)))
    high = max(low, round(args.max_tokens * (1 + args.max_tokens_spread)))
    return [rng.randint(low, high) for _ in range(count)]


def _workload(rng: random.Random, lengths: list[int], words: int) -> list[tuple[str, int]]:
    """Fresh random-word prompts (no prefix-cache hits) paired with the round's output lengths."""
    return [(" ".join(f"w{rng.randrange(10**6)}" for _ in range(words)), n) for n in lengths]


async def _direct_round(client: AsyncEngineClient, text_api: PromptTokenizer | None, tokenizer,
                        work: list[tuple[str, int]], args, out: Samples) -> None:  # fmt: skip
    """One closed-loop round straight into the engine client. `text_api` None: token ids in and out,
    prompts tokenized before the clock starts (the engine alone). Otherwise text in and text out in
    this process, with the server's own tokenizer and detokenizer objects (the engine's Python API
    as a library user would call it): what HTTP adds on top of that is the HTTP path's difference."""
    pending = iter(work if text_api is not None else [(tokenizer.encode(p, add_special_tokens=True), n) for p, n in work])

    async def worker() -> None:
        for index, (prompt, max_tokens) in enumerate(pending):
            record = out if index >= args.ramp_requests else Samples()  # a worker's first requests: ramp-up
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            started, started_wall = time.perf_counter(), time.time()
            request_id = uuid.uuid4().hex
            prompt_ids = prompt if text_api is None else (await text_api.encode_many([prompt]))[0]
            state = RequestState.create(request_id, prompt_ids, params, text_api.decoder) if text_api is not None else None
            queue = await client.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params))
            last = None
            events: list = []
            while True:
                output = await queue.get()
                now = time.perf_counter()
                events.extend(output.events)
                shown = output.new_token_ids if state is None else [t for t in [state.apply(output).new_text] if t]
                if shown:
                    record.tokens += len(shown)
                    if last is None:
                        record.ttft_ms.append((now - started) * 1000)
                        record.breakdowns.append(_direct_breakdown(started_wall, time.time(), now - started, events))
                    else:
                        record.tbt_ms.append((now - last) * 1000)
                    last = now
                if output.finish_reason is not None:
                    break

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))


def _direct_breakdown(sent_wall: float, received_wall: float, ttft_s: float, events: list) -> dict[str, float]:
    """The engine's share of a direct request's TTFT, split as servelm.obs splits an HTTP one
    (no ingress: the request goes straight to the core; `output` is core → this process)."""
    breakdown = attribute_ttft(
        received=sent_wall, sent_to_core=sent_wall, first_output_received=received_wall,
        first_token_detokenized=received_wall, end=received_wall, ttft_mono=ttft_s, events=events,
    )  # fmt: skip
    return breakdown.as_ms() if breakdown is not None else {}


def _with_socket_legs(timeline: dict, sent_wall: float, first_wall: float) -> dict[str, float]:
    """The server's TTFT split plus the two legs it cannot see (wall clock, one host): the request's
    trip from this client to the server's ASGI app, and the first token's from the socket to here."""
    breakdown = dict(timeline["ttft_breakdown_ms"] or {})
    written = timeline["api_ms"].get("first_byte_written")
    if breakdown and written is not None:
        breakdown["client_to_api"] = (timeline["received_unix"] - sent_wall) * 1000
        breakdown["socket_to_client"] = (first_wall - timeline["received_unix"]) * 1000 - written
    return breakdown


class _SSEConnection:
    """A minimal keep-alive HTTP/1.1 client for our own SSE responses.

    httpx costs the client ~100 µs of Python per event; with 32 streams on a 2-core machine
    that CPU is taken from the server and the engine and would be billed to the API. This
    client (one chunked-encoding read + one msgspec decode per event) measures the server."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def stream(self, path: str, body: dict):
        if self.writer is None:
            await self.connect()
        payload = msgspec.json.encode(body)
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))  # fmt: skip
        head = await self.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
        while True:
            size = int(await self.reader.readuntil(b"\r\n"), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return
            for event in chunk[:-2].split(b"\n\n"):
                if event.startswith(b"data: {"):
                    yield msgspec.json.decode(event[6:])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _http_round(port: int, work: list[tuple[str, int]], args, out: Samples) -> None:
    pending = iter(work)
    # Keep-alive connections opened before the clock starts, as a client's pool holds them: the
    # TCP handshake is not per request, and the direct path has no counterpart to it.
    connections = [_SSEConnection(port) for _ in range(args.concurrency)]
    await asyncio.gather(*(c.connect() for c in connections))

    async def worker(connection: _SSEConnection) -> None:
        try:
            for index, (prompt, max_tokens) in enumerate(pending):
                record = out if index >= args.ramp_requests else Samples()  # a worker's first requests: ramp-up
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "servelm": {"timeline": True}}  # fmt: skip
                started, sent_wall = time.perf_counter(), time.time()
                last, first_wall = None, None
                async for chunk in connection.stream("/v1/completions", body):
                    now = time.perf_counter()
                    if "servelm" in chunk and first_wall is not None:
                        record.breakdowns.append(_with_socket_legs(chunk["servelm"]["timeline"], sent_wall, first_wall))
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        record.tokens += 1
                        out.streamed_tokens += 1
                        if last is None:
                            record.ttft_ms.append((now - started) * 1000)
                            first_wall = time.time()
                        else:
                            record.tbt_ms.append((now - last) * 1000)
                        last = now
        finally:
            connection.close()

    await asyncio.gather(*(worker(c) for c in connections))


def _engine_flags(args) -> dict:
    return {"num_blocks": args.num_blocks, "num_threads": 1, "max_num_seqs": 256, "max_num_batched_tokens": 2048}


PATHS = {  # key → what the table calls it
    "ids": "engine direct, token ids (AsyncEngineClient)",
    "text": "engine direct, text (+ tokenize/detokenize in-process)",
    "http": "HTTP API (`servelm serve`, SSE)",
}


async def _run(args, model: str) -> dict[str, Samples]:
    from servelm.tokenization.loading import load_tokenizer

    flags = _engine_flags(args)
    cli = [item for key, value in flags.items() for item in (f"--{key.replace('_', '-')}", str(value))]
    server = launch_server(model, cli + ["--max-waiting-requests", "4096"])
    client = AsyncEngineClient(EngineConfig.from_flat(model=model, **flags))
    totals = {path: Samples() for path in PATHS}
    text_api: PromptTokenizer | None = None
    try:
        await client.start()
        if args.pin_engine:
            args.pinning = _pin_engines([client.process_pid, *_children(server.process.pid)], [os.getpid(), server.process.pid])
            print(args.pinning, flush=True)
        tokenizer = load_tokenizer(model)
        text_api = PromptTokenizer(tokenizer)
        rng = random.Random(args.seed)
        per_round = args.concurrency * args.requests_per_worker
        for round_index in range(args.rounds + 1):  # round 0 warms every path up and is dropped
            order = list(PATHS) if round_index % 2 == 0 else list(reversed(PATHS))  # drift hits all paths alike
            lengths = _output_lengths(rng, per_round, args)  # the same for every path of the round
            for path in order:
                samples, work = Samples(), _workload(rng, lengths, args.prompt_words)
                if path == "http":
                    cpu_before = _cpu_seconds(server.process.pid)
                    await _http_round(server.port, work, args, samples)
                    samples.api_cpu_s = _cpu_seconds(server.process.pid) - cpu_before
                else:
                    await _direct_round(client, text_api if path == "text" else None, tokenizer, work, args, samples)
                if round_index > 0:
                    totals[path].add_round(samples)
    finally:
        if text_api is not None:
            text_api.shutdown()
        await client.shutdown()
        server.stop()
    return totals


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _overhead_rows(http: Samples, base: Samples, base_name: str) -> tuple[list[str], bool]:
    """http − base: pooled medians, and per-round paired differences (the same round saw the same load)."""
    d_ttft = statistics.median(http.ttft_ms) - statistics.median(base.ttft_ms)
    d_tbt = statistics.median(http.tbt_ms) - statistics.median(base.tbt_ms)
    deltas = [(h[0] - b[0], h[1] - b[1]) for b, h in zip(base.round_medians, http.round_medians)]
    ok = d_ttft <= TTFT_BUDGET_MS and d_tbt <= TBT_BUDGET_MS
    rows = [
        f"- **http − {base_name}**: TTFT p50 **{d_ttft:+.2f} ms** (budget {TTFT_BUDGET_MS}), TBT p50 **{d_tbt:+.2f} ms** "
        f"(budget {TBT_BUDGET_MS}): {'PASS' if ok else 'FAIL'}. Per round: TTFT "
        + ", ".join(f"{t:+.1f}" for t, _ in deltas) + f" (median {statistics.median(t for t, _ in deltas):+.2f}); TBT "
        + ", ".join(f"{b:+.2f}" for _, b in deltas) + f" (median {statistics.median(b for _, b in deltas):+.2f})."
    ]  # fmt: skip
    return rows, ok


def _table(totals: dict[str, Samples], args) -> str:
    rows = ["| path | tokens | TTFT p50 (ms) | TTFT p90 (ms) | TBT p50 (ms) | TBT p90 (ms) |", "|---|---|---|---|---|---|"]
    for path, s in totals.items():
        rows.append(f"| {PATHS[path]} | {s.tokens} | {statistics.median(s.ttft_ms):.2f} | {_percentile(s.ttft_ms, 90):.2f} | "
                    f"{statistics.median(s.tbt_ms):.2f} | {_percentile(s.tbt_ms, 90):.2f} |")  # fmt: skip
    rows.append("")
    http = totals["http"]
    verdicts = []
    for base, name in (("text", "direct text"), ("ids", "direct ids")):
        lines, ok = _overhead_rows(http, totals[base], name)
        rows += lines
        verdicts.append(f"{name} {'PASS' if ok else 'FAIL'}")
    rows += ["", *_split_table(totals), ""]
    if http.streamed_tokens:
        rows.append(f"API process CPU per streamed token (all of its work, amortized): {http.api_cpu_s / http.streamed_tokens * 1e6:.0f} µs.")
        rows.append("")
    if getattr(args, "pinning", ""):
        rows.append(f"Pinning: {args.pinning}.")
    rows.append(f"{'; '.join(verdicts)}: {args.concurrency} concurrent streams, {args.rounds} rounds x "
                f"{args.concurrency * args.requests_per_worker} requests per path, ~{args.prompt_words} random words per "
                f"prompt, {args.max_tokens} output tokens (± {args.max_tokens_spread:.0%}).")  # fmt: skip
    return "\n".join(rows)


def _split_table(totals: dict[str, Samples]) -> list[str]:
    """Median TTFT components of every path: `queue` + `prefill` are the engine's time, the rest the path's own."""
    parts = ("client_to_api", "ingress", "queue", "prefill", "preemption", "output", "core_to_api", "socket_to_client")
    rows = ["TTFT split (medians, ms; servelm.obs attribution from the core's events; `core_to_api`, part of "
            "`output`, is the first token's trip from the core to the receiving process; `client_to_api` and "
            "`socket_to_client` are the HTTP legs outside the server's own timeline; direct text counts its "
            "tokenization in `queue`):", "",
            "| path | " + " | ".join(parts) + " |", "|---|" + "---|" * len(parts)]  # fmt: skip
    for path, samples in totals.items():
        found = [b for b in samples.breakdowns if b]
        if found:
            rows.append(f"| {path} | " + " | ".join(f"{statistics.median(b.get(p, 0.0) for b in found):.2f}" for p in parts) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: a tiny random Llama written to a temp dir)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests-per-worker", type=int, default=3)
    parser.add_argument("--ramp-requests", type=int, default=1,
                        help="each worker's first N requests are not measured: they start together, as one burst")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-tokens-spread", type=float, default=0.5,
                        help="output lengths uniform in max_tokens x [1-s, 1+s]; 0 = every stream the same length (bursty)")  # fmt: skip
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pin-engine", action="store_true",
                        help="engine cores on CPU 0, API and client on the rest (isolates the API's own cost on few cores)")  # fmt: skip
    parser.add_argument("--machine", default="", help="a description for the results file")
    parser.add_argument("--results", type=Path, default=None, help="append the table to this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from servelm.testing.tiny_model import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "tiny", seed=0))
        totals = asyncio.run(_run(args, model))
    table = _table(totals, args)
    print(table)
    if args.results is not None:
        _append(args.results, table, args)


def _append(path: Path, table: str, args) -> None:
    flags = [(k.replace("_", "-"), v) for k, v in vars(args).items() if v not in (None, "", False) and k not in ("results", "machine", "pinning")]
    command = "python benchmarks/serving_overhead.py " + " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in flags)
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if "## Serving overhead (issue 4)" not in text:
        text = text.rstrip() + "\n\n## Serving overhead (issue 4)\n"
    model = args.model or "tiny random Llama (2 layers, hidden 64, vocab 49152; servelm.testing.tiny_model)"
    text = text.rstrip() + (
        f"\n\n### {datetime.date.today().isoformat()} — {args.machine or 'unspecified machine'}\n\n"
        f"Model: {model}. Command: `{command}`\n\n{table}\n"
    )
    path.write_text(text)


if __name__ == "__main__":
    main()
