"""What the HTTP API adds to TTFT and TBT: the same workload through `servelm serve` and straight
into the engine, in one run.

    direct:  this process ── AsyncEngineClient ──ZMQ──▶ engine core          (token ids in and out)
    http:    this process ── HTTP/SSE ──▶ servelm serve ── AsyncEngineClient ──ZMQ──▶ engine core
             (text in: validation, tokenization, detokenization, SSE framing, the client's parsing)

Both engines are identical (same flags, one torch thread each) and never run at the same time:
rounds alternate direct / http so drift in machine load hits both. Each round is a closed loop of
`--concurrency` workers, each sending `--requests-per-worker` requests back to back, with fresh
random prompts (no prefix-cache hits across rounds). TTFT: request sent → first token received.
TBT: the gaps between a request's successive token arrivals. Targets (issue 4): the API may add
at most 5 ms to median TTFT and 1 ms to median TBT at 32 concurrent streams.

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
from servelm.sampling_params import SamplingParams
from servelm.server.launcher import launch_server

TTFT_BUDGET_MS, TBT_BUDGET_MS = 5.0, 1.0


@dataclass
class Samples:
    ttft_ms: list[float] = field(default_factory=list)
    tbt_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    breakdowns: list[dict[str, float]] = field(default_factory=list)  # the server's TTFT split (http only)
    api_cpu_s: float = 0.0  # CPU time the API server process spent (http only)


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc): what it took from the machine, whatever the load."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _prompts(rng: random.Random, count: int, words: int) -> list[str]:
    return [" ".join(f"w{rng.randrange(10**6)}" for _ in range(words)) for _ in range(count)]


async def _direct_round(client: AsyncEngineClient, tokenizer, prompts: list[str], args, out: Samples) -> None:
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]  # tokenized up front: not engine time
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    pending = iter(ids)

    async def worker() -> None:
        for prompt_ids in pending:
            started = time.perf_counter()
            queue = await client.add_request(EngineRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt_ids, sampling_params=params))
            last = None
            while True:
                output = await queue.get()
                now = time.perf_counter()
                if output.new_token_ids:
                    out.tokens += len(output.new_token_ids)
                    (out.ttft_ms if last is None else out.tbt_ms).append((now - (started if last is None else last)) * 1000)
                    last = now
                if output.finish_reason is not None:
                    break

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))


class _SSEConnection:
    """A minimal keep-alive HTTP/1.1 client for our own SSE responses.

    httpx costs the client ~100 µs of Python per event; with 32 streams on a 2-core machine
    that CPU is taken from the server and the engine and would be billed to the API. This
    client (one chunked-encoding read + one msgspec decode per event) measures the server."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, path: str, body: dict):
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
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


async def _http_round(port: int, prompts: list[str], args, out: Samples) -> None:
    pending = iter(prompts)

    async def worker() -> None:
        connection = _SSEConnection(port)
        try:
            for prompt in pending:
                body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "servelm": {"timeline": True}}  # fmt: skip
                started = time.perf_counter()
                last = None
                async for chunk in connection.stream("/v1/completions", body):
                    now = time.perf_counter()
                    if "servelm" in chunk:
                        out.breakdowns.append(chunk["servelm"]["timeline"]["ttft_breakdown_ms"])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        out.tokens += 1
                        (out.ttft_ms if last is None else out.tbt_ms).append((now - (started if last is None else last)) * 1000)
                        last = now
        finally:
            connection.close()

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))


def _engine_flags(args) -> dict:
    return {"num_blocks": args.num_blocks, "num_threads": 1, "max_num_seqs": 256, "max_num_batched_tokens": 2048}


async def _run(args, model: str) -> tuple[Samples, Samples]:
    from servelm.models.tokenizer import load_tokenizer

    flags = _engine_flags(args)
    cli = [item for key, value in flags.items() for item in (f"--{key.replace('_', '-')}", str(value))]
    server = launch_server(model, cli + ["--max-waiting-requests", "4096"])
    client = AsyncEngineClient(EngineConfig.from_flat(model=model, **flags))
    direct, http_samples = Samples(), Samples()
    try:
        await client.start()
        tokenizer = load_tokenizer(model)
        rng = random.Random(args.seed)
        per_round = args.concurrency * args.requests_per_worker
        for round_index in range(args.rounds + 1):  # round 0 warms both paths up and is dropped
            keep = round_index > 0
            await _direct_round(client, tokenizer, _prompts(rng, per_round, args.prompt_words), args, direct if keep else Samples())
            cpu_before = _cpu_seconds(server.process.pid)
            await _http_round(server.port, _prompts(rng, per_round, args.prompt_words), args, http_samples if keep else Samples())
            http_samples.api_cpu_s += (_cpu_seconds(server.process.pid) - cpu_before) if keep else 0.0
    finally:
        await client.shutdown()
        server.stop()
    return direct, http_samples


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _table(direct: Samples, http: Samples, args) -> str:
    rows = ["| path | tokens | TTFT p50 (ms) | TTFT p90 (ms) | TBT p50 (ms) | TBT p90 (ms) |", "|---|---|---|---|---|---|"]
    for name, s in (("engine direct (AsyncEngineClient)", direct), ("HTTP API (`servelm serve`, SSE)", http)):
        rows.append(f"| {name} | {s.tokens} | {statistics.median(s.ttft_ms):.2f} | {_percentile(s.ttft_ms, 90):.2f} | "
                    f"{statistics.median(s.tbt_ms):.2f} | {_percentile(s.tbt_ms, 90):.2f} |")  # fmt: skip
    d_ttft = statistics.median(http.ttft_ms) - statistics.median(direct.ttft_ms)
    d_tbt = statistics.median(http.tbt_ms) - statistics.median(direct.tbt_ms)
    verdict = "PASS" if d_ttft <= TTFT_BUDGET_MS and d_tbt <= TBT_BUDGET_MS else "FAIL"
    rows.append(f"| **API overhead (http − direct)** | | **{d_ttft:+.2f}** (budget {TTFT_BUDGET_MS}) | | "
                f"**{d_tbt:+.2f}** (budget {TBT_BUDGET_MS}) | | ")  # fmt: skip
    rows.append("")
    if http.breakdowns:
        parts = ("ingress", "queue", "prefill", "preemption", "output")
        medians = ", ".join(f"{p} {statistics.median(b[p] for b in http.breakdowns):.2f}" for p in parts)
        rows.append(f"Server-side TTFT split of the HTTP requests (medians, ms; servelm.obs): {medians}.")
        rows.append(f"API process CPU per streamed token (all of its work, amortized): {http.api_cpu_s / http.tokens * 1e6:.0f} µs.")
        rows.append("")
    rows.append(f"{verdict}: {args.concurrency} concurrent streams, {args.rounds} rounds x {args.concurrency * args.requests_per_worker} "
                f"requests per path, ~{args.prompt_words} random words per prompt, {args.max_tokens} output tokens.")  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: a tiny random Llama written to a temp dir)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests-per-worker", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machine", default="", help="a description for the results file")
    parser.add_argument("--results", type=Path, default=None, help="append the table to this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from servelm.testing.tiny_model import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "tiny", seed=0))
        direct, http = asyncio.run(_run(args, model))
    table = _table(direct, http, args)
    print(table)
    if args.results is not None:
        _append(args.results, table, args)


def _append(path: Path, table: str, args) -> None:
    command = "python benchmarks/serving_overhead.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, "") and k not in ("results", "machine")
    )
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
