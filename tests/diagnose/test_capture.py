"""WindowRecorder against a real server: the files of the window layout, their contents, its errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from servelm.diagnose.capture import (
    BENCH_FILE,
    GAUGES_FILE,
    METRICS_END_FILE,
    METRICS_START_FILE,
    WINDOW_FILE,
    CaptureError,
    WindowRecorder,
)
from servelm.diagnose.prom import parse_text


def _successes(text: str) -> float:
    family = parse_text(text)["servelm:request_success"]
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


async def _send(base_url: str, num_requests: int) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        body = {"prompt": "Count the requests of this window", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(num_requests)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]


def test_window_files_hold_the_window(server, tmp_path: Path):
    out = tmp_path / "window"

    async def record() -> None:
        async with WindowRecorder(server.base_url, out, "baseline", sample_interval_s=0.2) as recorder:
            await _send(server.base_url, 5)
            await asyncio.sleep(0.7)
            recorder.write_bench_report({"schema": "servelm-bench/1", "kind": "run", "requests": []})

    asyncio.run(record())
    window = json.loads((out / WINDOW_FILE).read_text())
    assert window["label"] == "baseline" and window["source"] == server.base_url
    assert window["end_unix"] - window["start_unix"] >= 0.7
    samples = [json.loads(line) for line in (out / GAUGES_FILE).read_text().splitlines()]
    assert len(samples) == window["num_samples"] >= 4, "start, end and the samples between"
    assert window["num_failed_samples"] == 0
    times = [s["t"] for s in samples]
    assert times == sorted(times) and times[0] == window["start_unix"] and times[-1] == window["end_unix"]
    assert all("servelm:num_requests_waiting" in s and "servelm:kv_cache_usage_perc" in s for s in samples)
    start, end = (out / METRICS_START_FILE).read_text(), (out / METRICS_END_FILE).read_text()
    assert _successes(end) - _successes(start) == 5, "the window's requests, counted by the server"
    assert json.loads((out / BENCH_FILE).read_text())["kind"] == "run"


def test_errors_are_named(server, tmp_path: Path):
    with pytest.raises(CaptureError, match="cannot read"):
        asyncio.run(WindowRecorder("http://127.0.0.1:9", tmp_path / "x", "x").__aenter__())
    with pytest.raises(ValueError, match="not a servelm bench report"):
        WindowRecorder(server.base_url, tmp_path / "y", "y").write_bench_report({"schema": "other"})
    with pytest.raises(ValueError, match="sample_interval_s"):
        WindowRecorder(server.base_url, tmp_path / "z", "z", sample_interval_s=0)
