"""The calibration plan, sent to a real `servelm serve` over HTTP as its clients would send it.

Phases (CalibrationPlan says the sizes), each over streamed /v1/completions with token-id prompts
of random tokens (no prefix is shared unless a phase means it to be):

    prompts alone        one at a time, one output token: a prompt step of each length (tokens,
                         the pass over the weights, attention pairs; long ones chunked as the
                         step-time target cuts them, deep chunks laid over their context)
    decode batches       B streams at once over prompts sharing all but their last tokens: decode
                         steps of B rows over that context (rows, the context each reads)
    next turns           a prompt whose first tokens an earlier one cached, then new ones: a chunk
                         after cached context, what a conversation's next turn is
    long beside streams  a long prompt chunked while a few streams decode: mixed steps

The engine core traces every step (engine/step_trace.py); this module only makes the traffic and
keeps what the client saw of the one-step prompts (their TTFT), from which the request's cost
outside the engine follows.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

LONG_PROMPT = 1024  # prompts this long are sent once whatever the plan's repeats
DISTINCT_TAIL = 8  # tokens of a decode batch's prompts that are each request's own
ONE_STEP_PROMPT = 128  # prompts this short run in one step: their TTFT is the request's way plus one step


@dataclass(frozen=True)
class CalibrationPlan:
    prompt_lengths: tuple[int, ...] = (32, 128, 512, 1024, 2048, 4096)  # prompts alone (cut to the context window)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # streams decoding together
    decode_contexts: tuple[int, ...] = (64, 1024)  # their prompts' length
    decode_tokens: int = 12  # tokens each decodes
    long_beside: int = 2048  # a prompt chunked beside `beside_streams` decoding ones (0: none)
    beside_streams: int = 4
    repeats: int = 2  # each short prompt-alone length this many times (timings jitter)
    # A conversation's next turn: a prompt whose first `depth` tokens are cached, then `chunk` new ones.
    hit_depths: tuple[int, ...] = (256, 1024, 2048)
    hit_chunks: tuple[int, ...] = (16, 64, 256)


# The CI size: a tiny model, a few seconds.
QUICK_PLAN = CalibrationPlan(prompt_lengths=(16, 64, 256), decode_batches=(1, 4, 8), decode_contexts=(32, 200),
                             decode_tokens=6, long_beside=400, beside_streams=2, repeats=1, hit_depths=(128,),
                             hit_chunks=(16, 64))  # fmt: skip


@dataclass(frozen=True)
class OneStepPrompt:
    num_tokens: int  # as sent (the server adds no BOS to token ids)
    ttft_s: float  # what the client waited for its first token


def drive_plan(base_url: str, plan: CalibrationPlan, vocab_size: int, max_model_len: int) -> list[OneStepPrompt]:
    """Send the plan; the TTFTs of its short prompts sent alone."""
    rng = random.Random(0)
    longest = max_model_len - plan.decode_tokens - 1
    one_step: list[OneStepPrompt] = []

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(count)]

    with httpx.Client(base_url=base_url, timeout=600) as http, ThreadPoolExecutor(max(plan.decode_batches, default=1)) as pool:

        def together(prompts: list[list[int]], max_tokens: int) -> None:
            list(pool.map(lambda p: _stream(http, p, max_tokens), prompts))

        for length in plan.prompt_lengths:
            for _ in range(plan.repeats if length < LONG_PROMPT else 1):
                prompt = tokens(min(length, longest))
                ttft = _stream(http, prompt, 1)
                if len(prompt) <= ONE_STEP_PROMPT:
                    one_step.append(OneStepPrompt(len(prompt), ttft))
        for context in plan.decode_contexts:
            shared = tokens(max(0, min(context, longest) - DISTINCT_TAIL))
            for batch in plan.decode_batches:
                together([shared + tokens(DISTINCT_TAIL) for _ in range(batch)], plan.decode_tokens)
        for depth in plan.hit_depths:
            cached = tokens(min(depth, longest - max(plan.hit_chunks, default=0)))
            _stream(http, cached, 1)
            for chunk in plan.hit_chunks:
                _stream(http, cached + tokens(chunk), 1)
        if plan.long_beside:
            streams = [tokens(32) for _ in range(plan.beside_streams)]
            running = [pool.submit(_stream, http, p, 4 * plan.decode_tokens) for p in streams]
            time.sleep(0.2)  # the streams decode before the long prompt arrives
            _stream(http, tokens(min(plan.long_beside, longest)), 1)
            for future in running:
                future.result()
    return one_step


def _stream(http: httpx.Client, prompt: list[int], max_tokens: int) -> float:
    """One streamed completion, read to its end; its TTFT."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    sent = time.perf_counter()
    first: float | None = None
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices"):
                    first = time.perf_counter()
    if first is None:
        raise RuntimeError("a calibration stream carried no token")
    return first - sent
