"""What a request and a step cost outside the engine loop, measured on a real `servelm serve`.

The in-process calibration times the engine loop; a client of the server also waits for HTTP,
tokenization and the trip between the API process and the engine core, once per request on
the way in and on every step's way out. The probe starts the server with the calibrated
engine's flags and measures, beyond what the profile predicts for the same steps:

    step overhead     a lone stream's token gaps (median) minus its decode step's period
    row overhead      PROBE_ROWS streams at once: their gaps beyond their steps' period and the step
                      overhead, per stream (on a few cores the API process's work for each token
                      it sends takes the engine's CPU: it grows with the rows)
    request overhead  a short prompt's TTFT (median of several, one at a time) minus its prefill
                      step's period and that step's overhead
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from servelm.config import flag_arguments
from servelm.scheduler.step_cost import StepShape
from servelm.server.launcher import launch_server
from servelm.simulate.profile import CostProfile

PROBE_PROMPT_TOKENS = 16
PROBE_REQUESTS = 8  # one at a time; the first is left out (a cold path)
PROBE_STREAM_TOKENS = 64
PROBE_ROWS = 8  # streams at once for the per-row cost


@dataclass(frozen=True)
class ServerCosts:
    """What the server adds beyond the profile's engine loop, in seconds, each at least 0."""

    request_s: float
    step_s: float
    row_s: float


def probe_server(engine_flags: dict[str, Any], profile: CostProfile) -> ServerCosts:
    model = engine_flags.get("model")
    arguments = flag_arguments({k: v for k, v in engine_flags.items() if k != "model"})
    with launch_server(model, arguments) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        ttfts = [_stream(http, _prompt(i), 1)[0] for i in range(PROBE_REQUESTS)][1:]
        gaps = _stream(http, _prompt(PROBE_REQUESTS), PROBE_STREAM_TOKENS)[1]
        with ThreadPoolExecutor(PROBE_ROWS) as pool:
            streams = list(pool.map(lambda i: _stream(http, _prompt(i), PROBE_STREAM_TOKENS)[1],
                                    range(PROBE_REQUESTS + 1, PROBE_REQUESTS + 1 + PROBE_ROWS)))  # fmt: skip
    prefill = profile.step_s(StepShape(dense_passes=1.0) + StepShape.chunk(PROBE_PROMPT_TOKENS, 0), 1)
    step_overhead = max(0.0, statistics.median(gaps) - _decode_period(profile, 1))
    # The streams start a step or two apart; their gaps in the middle are steps of all of them.
    together = [gap for stream in streams for gap in stream[PROBE_STREAM_TOKENS // 4 : -PROBE_STREAM_TOKENS // 4]]
    beyond = statistics.median(together) - _decode_period(profile, PROBE_ROWS) - step_overhead
    request_overhead = max(0.0, statistics.median(ttfts) - prefill - step_overhead)
    return ServerCosts(request_overhead, step_overhead, max(0.0, beyond / PROBE_ROWS))


def _decode_period(profile: CostProfile, rows: int) -> float:
    """The mean period of a probe stream's decode steps with `rows` such streams in each."""
    return statistics.fmean(
        profile.step_s(sum((StepShape.decode(1, PROBE_PROMPT_TOKENS + i) for _ in range(rows)), StepShape()), rows)
        for i in range(PROBE_STREAM_TOKENS)
    )


def _prompt(index: int) -> list[int]:
    """Token ids no other probe prompt shares (no prefix hits)."""
    start = 1000 + index * PROBE_PROMPT_TOKENS
    return list(range(start, start + PROBE_PROMPT_TOKENS))


def _stream(http: httpx.Client, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, the gaps between the later chunks) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    sent = time.perf_counter()
    times: list[float] = []
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("the probe's stream carried no text")
    return times[0] - sent, [b - a for a, b in zip(times, times[1:])]
