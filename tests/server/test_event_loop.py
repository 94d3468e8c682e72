"""Tokenizing a very long prompt must not stall other clients' streams: it runs off the event loop.

Streams run while a ~600k-character prompt is posted; the server tokenizes it (hundreds of ms)
and rejects it as longer than the context window. The server's context is 8,192 tokens: a prompt
that long passes the size check made before tokenizing (server/prompt_limits.py: 8,192 x the
longest vocabulary entry), so it is really tokenized. Had tokenization run on the event loop,
every stream would see one gap as long as the tokenization; the largest gap during that window
must stay well under it.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from helpers_http import wait_idle
from servelm.server.launcher import launch_server

NUM_STREAMS = 4
LONG_CONTEXT = 8192


@pytest.fixture(scope="module")
def long_context_server(tiny_model_dir):
    args = ["--hf-overrides", json.dumps({"max_position_embeddings": LONG_CONTEXT}), "--num-blocks", "640",
            "--num-threads", "1"]  # fmt: skip
    with launch_server(tiny_model_dir, args) as process:
        yield process


async def _stream_gaps(client: httpx.AsyncClient, i: int, arrivals: list[float], stop: asyncio.Event) -> None:
    body = {"prompt": f"Stream {i} keeps going", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
            if stop.is_set():
                break


def _max_gap(arrivals: list[float], start: float, end: float) -> float:
    """Largest gap between consecutive chunks that overlaps [start, end]."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= start and a <= end]
    return max(gaps, default=0.0)


def test_long_prompt_tokenization_does_not_stall_streams(long_context_server):
    server = long_context_server
    huge = " ".join(f"w{i % 977}x" for i in range(100_000))  # ~600k characters, ~250k tokens

    async def main() -> tuple[float, list[list[float]], float, float, float]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            stop = asyncio.Event()
            arrivals: list[list[float]] = [[] for _ in range(NUM_STREAMS)]
            tasks = [asyncio.create_task(_stream_gaps(client, i, arrivals[i], stop)) for i in range(NUM_STREAMS)]
            while min(len(a) for a in arrivals) < 20:  # streams warmed up and flowing
                await asyncio.sleep(0.02)
            start = time.perf_counter()
            response = await client.post("/v1/completions", json={"prompt": huge, "max_tokens": 1})
            end = time.perf_counter()
            await asyncio.sleep(0.1)
            stop.set()
            await asyncio.gather(*tasks)
            assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
            baseline = max(_max_gap(a, a[0], start - 0.05) for a in arrivals)
            return end - start, arrivals, start, end, baseline

    tokenize_s, arrivals, start, end, baseline = asyncio.run(main())
    worst = max(_max_gap(a, start, end) for a in arrivals)
    assert tokenize_s > 0.2, f"the long prompt took only {tokenize_s * 1000:.0f} ms: too short to tell"
    assert worst < 0.35 * tokenize_s, (
        f"a stream stalled {worst * 1000:.0f} ms while a {tokenize_s * 1000:.0f} ms tokenization ran "
        f"(largest gap before: {baseline * 1000:.0f} ms)"
    )
    wait_idle(server)
