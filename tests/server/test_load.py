"""Bounded load: 200 concurrent streams all complete with exactly their tokens, and the KV pool
is empty afterwards; clients that drop mid-stream (or mid-wait) leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from helpers_http import metric_value, scrape, wait_idle

NUM_STREAMS = 200


async def _stream(client: httpx.AsyncClient, i: int) -> tuple[int, int, int, str]:
    """One stream; (expected tokens, tokens seen in chunks, usage tokens, finish reason)."""
    max_tokens = 4 + i % 13
    body = {"prompt": f"Stream {i}: the numbers go {i} {i + 1} {i + 2}", "max_tokens": max_tokens, "temperature": 0.7,
            "seed": i, "ignore_eos": True, "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    seen, usage_tokens, finish = 0, -1, ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                seen += len(choice["logprobs"]["tokens"]) if choice["logprobs"] else 0
                finish = choice["finish_reason"] or finish
            if chunk.get("usage"):
                usage_tokens = chunk["usage"]["completion_tokens"]
    return max_tokens, seen, usage_tokens, finish


def test_200_concurrent_streams_complete_and_free_every_block(server):
    async def main():
        limits = httpx.Limits(max_connections=NUM_STREAMS + 10)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=180, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, i) for i in range(NUM_STREAMS)))

    before = scrape(server)
    finished_before = _finished(before, "length")
    results = asyncio.run(main())
    wrong = [(i, r) for i, r in enumerate(results) if r != (r[0], r[0], r[0], "length")]
    assert not wrong, wrong[:5]
    text = wait_idle(server)  # running, waiting, in-API requests and used KV blocks all back to 0
    assert metric_value(text, "servelm:kv_cache_used_blocks") == 0
    assert _finished(text, "length") - finished_before == NUM_STREAMS
    assert metric_value(text, "servelm:generation_tokens_total") >= sum(r[0] for r in results)
    # Every step reached the step histograms, mid-prefill steps (which send no outputs) included.
    steps = metric_value(text, "servelm:engine_step_seconds_count") - metric_value(before, "servelm:engine_step_seconds_count")
    assert steps == metric_value(text, "servelm:iteration_tokens_count") - metric_value(before, "servelm:iteration_tokens_count")
    assert steps >= max(r[0] for r in results)  # at least one step per token of the longest stream
    scheduled = metric_value(text, "servelm:iteration_tokens_sum") - metric_value(before, "servelm:iteration_tokens_sum")
    assert scheduled >= sum(r[0] - 1 for r in results)  # each stream's decode steps, prompts on top


def test_clients_that_disconnect_leave_no_request_and_no_block(server):
    wait_idle(server)
    aborted_before = _finished(scrape(server), "abort")

    async def drop_after_two_chunks(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Endless story {i}", "max_tokens": 900, "ignore_eos": True, "stream": True}
        chunks = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                chunks += line.startswith("data: {")
                if chunks == 2:
                    break  # leaving the block closes the connection mid-stream
        return chunks

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            dropped = await asyncio.gather(*(drop_after_two_chunks(client, i) for i in range(12)))
        # A non-streaming client that gives up while its request is still generating.
        async with httpx.AsyncClient(base_url=server.base_url, timeout=1.0) as impatient:
            try:
                await impatient.post("/v1/completions", json={"prompt": "Long answer", "max_tokens": 900, "ignore_eos": True})
            except httpx.ReadTimeout:
                pass
        return dropped

    started = time.monotonic()
    assert asyncio.run(main()) == [2] * 12
    text = wait_idle(server, timeout_s=15)
    # 13 requests of 900 tokens cannot have finished by themselves this soon: they were aborted.
    assert time.monotonic() - started < 30
    assert _finished(text, "abort") - aborted_before == 13


def _finished(text: str, reason: str) -> float:
    try:
        return metric_value(text, "servelm:request_success_total", f'finished_reason="{reason}"')
    except KeyError:
        return 0.0
