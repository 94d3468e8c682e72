"""What a request and a step cost outside the engine loop, measured on a real `servelm serve`.

The in-process calibration times the engine loop; a client of the server also waits for HTTP,
tokenization and the trip between the API process and the engine core, once per request on
the way in and on every step's way out. The probe starts the server with the calibrated
engine's flags and measures, beyond what the profile predicts for the same steps:

    step overhead     a lone stream's token gaps (median) minus its decode step's period
    request overhead  a short prompt's TTFT (median of several, one at a time) minus its prefill
                      step's period and that step's overhead
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import httpx

from servelm.config import flag_arguments
from servelm.scheduler.step_cost import StepShape
from servelm.server.launcher import launch_server
from servelm.simulate.profile import CostProfile

PROBE_PROMPT_TOKENS = 16
PROBE_REQUESTS = 8  # one at a time; the first is left out (a cold path)
PROBE_STREAM_TOKENS = 64


def probe_server(engine_flags: dict[str, Any], profile: CostProfile) -> tuple[float, float]:
    """(request overhead, per-step overhead) in seconds, each at least 0."""
    model = engine_flags.get("model")
    arguments = flag_arguments({k: v for k, v in engine_flags.items() if k != "model"})
    with launch_server(model, arguments) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        ttfts = [_stream(http, _prompt(i), 1)[0] for i in range(PROBE_REQUESTS)][1:]
        gaps = _stream(http, _prompt(PROBE_REQUESTS), PROBE_STREAM_TOKENS)[1]
    prefill = profile.step_s(StepShape(dense_passes=1.0) + StepShape.chunk(PROBE_PROMPT_TOKENS, 0), 1)
    decode = statistics.fmean(profile.step_s(StepShape.decode(1, PROBE_PROMPT_TOKENS + i), 1)
                              for i in range(PROBE_STREAM_TOKENS))  # fmt: skip
    step_overhead = max(0.0, statistics.median(gaps) - decode)
    request_overhead = max(0.0, statistics.median(ttfts) - prefill - step_overhead)
    return request_overhead, step_overhead


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
