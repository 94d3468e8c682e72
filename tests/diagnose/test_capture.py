"""WindowRecorder against a real server: the files of the window layout, their contents, its errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from servelm.cli import main
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
from servelm.diagnose.signals import window_signals
from servelm.diagnose.window import read_window


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


def test_window_numbers_match_what_was_sent(server, tmp_path: Path):
    out = tmp_path / "window"
    prompts = [f"Request {i} of the arithmetic window, " + "word " * (10 * i) for i in range(1, 7)]

    async def record() -> list[dict]:
        async with WindowRecorder(server.base_url, out, "arithmetic", sample_interval_s=0.2):
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                bodies = [{"prompt": p, "max_tokens": 3, "temperature": 0, "ignore_eos": True} for p in prompts]
                responses = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
        return [r.json()["usage"] for r in responses]

    usages = asyncio.run(record())
    window = read_window(out)
    signals = window_signals(window)
    assert window.counter("servelm:request_success") == 6
    assert window.counter("servelm:prompt_tokens") == sum(u["prompt_tokens"] for u in usages)
    ttft = window.histogram("servelm:time_to_first_token_seconds")
    assert ttft is not None and ttft.count == 6 and ttft.mean is not None
    components = [signals.components[c] for c in ("ingress", "queue", "prefill", "preemption", "output")]
    assert sum(c or 0.0 for c in components) == pytest.approx(ttft.mean, rel=1e-6), "the split adds up to TTFT"
    assert signals.ttft_mean_s == pytest.approx(ttft.mean) and signals.components["network"] is None
    assert signals.values["request_rate"] == pytest.approx(6 / window.duration_s)
    assert signals.values["generation_tokens_per_request"] == 3.0
    assert signals.values["kv_usage_max"] is not None and 0.0 <= signals.values["kv_usage_max"] <= 1.0
    assert signals.values["waiting_mean"] is not None and signals.values["step_time_mean_s"] is not None
    steps = window.histogram("servelm:iteration_tokens")
    assert steps is not None and steps.sum >= sum(u["prompt_tokens"] for u in usages), (
        "every prompt token ran in a step"
    )
    assert "interactive" in signals.classes


def test_cli_capture_then_live_compare(server, tmp_path: Path, capsys):
    assert main(["diagnose", "capture", server.base_url, "--seconds", "0.6", "--out", str(tmp_path / "base")]) == 0
    assert json.loads((tmp_path / "base" / WINDOW_FILE).read_text())["label"] == "base"
    capsys.readouterr()
    live = ["diagnose", server.base_url, "--baseline", str(tmp_path / "base"), "--seconds", "0.6", "--json"]
    assert main([*live, "--out", str(tmp_path / "now")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["top_cause"] == "none", "no traffic in either window: nothing grew"
    assert report["windows"]["current"]["label"] == "current" and (tmp_path / "now" / METRICS_END_FILE).is_file()
