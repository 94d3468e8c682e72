"""`servelm bench` against a live `servelm serve` (tiny model, real HTTP, real processes).

The mixed run's request and token counts must equal the server's own /metrics counters; a
trace replays on its timestamps; closed loops hold their concurrency; every run stops at its
wall-clock limit or on Ctrl-C and still writes its report.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from servelm.bench.execute import BenchConfig, Load, prepare, run_once
from servelm.bench.sweep import run_sweep
from servelm.bench.workload import SLO
from servelm.server.launcher import ServerProcess

COUNTERS = ("servelm:prompt_tokens_total", "servelm:generation_tokens_total", "servelm:request_success_total")
SMALL = ["--length-scale", "0.2", "--max-output-tokens", "16", "--no-progress"]  # ~20-800-token prompts: fast on CPU
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _counters(server: ServerProcess) -> dict[str, float]:
    """Each counter summed over its labels, read straight from the exposition text."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def _bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "servelm.cli", "bench", *args]


@pytest.fixture(scope="module")
def mixed_run(bench_server: ServerProcess, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("mixed")
    before = _counters(bench_server)
    command = _bench("run", "--base-url", bench_server.base_url, "--tokenizer", str(tiny_model_dir), "--profile", "mixed",
                     "--weights", "voice=0.4,code=0.3,analytics=0.2,chat=0.1", "--rate", "4", "--num-requests", "16",
                     "--duration-s", "120", "--seed", "0", "--out", str(out), *SMALL)  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    after = _counters(bench_server)
    return out, done.stdout, {name: after[name] - before[name] for name in COUNTERS}


def test_mixed_run_writes_json_markdown_and_plots(mixed_run):
    out, stdout, _ = mixed_run
    report = json.loads((out / "run.json").read_text())
    assert report["kind"] == "run" and len(report["requests"]) == 16
    assert set(report["summary"]["classes"]) == {"voice", "code", "analytics", "chat"}
    markdown = (out / "summary.md").read_text()
    assert markdown == stdout.strip() + "\n" or markdown.strip() in stdout
    for name in ("voice", "code", "analytics", "chat", "**overall**"):
        assert f"| {name} |" in markdown
    assert "Mean TTFT split" in markdown
    for plot in ("cdf.png", "throughput.png", "ttft_breakdown.png"):
        data = (out / plot).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, plot
        assert f"]({plot})" in markdown


def test_mixed_run_counts_agree_with_the_server_metrics(mixed_run):
    out, _, delta = mixed_run
    report = json.loads((out / "run.json").read_text())
    records = report["requests"]
    assert all(r["status"] == "ok" and r["token_source"] == "usage" for r in records)
    # The report's delta is taken after the bench's one warm-up request; ours, from outside, includes it.
    counted = {k: report["server"]["metrics_delta"][k] for k in COUNTERS}
    assert counted["servelm:request_success_total"] == len(records) == delta["servelm:request_success_total"] - 1
    assert counted["servelm:prompt_tokens_total"] == sum(r["num_prompt_tokens"] for r in records)
    assert counted["servelm:generation_tokens_total"] == sum(r["num_output_tokens"] for r in records)
    assert delta["servelm:generation_tokens_total"] == counted["servelm:generation_tokens_total"] + 1  # warm-up: 1 token
    assert delta["servelm:prompt_tokens_total"] > counted["servelm:prompt_tokens_total"]
    overall = report["summary"]["overall"]
    assert overall["num_prompt_tokens"] == counted["servelm:prompt_tokens_total"]
    assert overall["num_output_tokens"] == counted["servelm:generation_tokens_total"]
    # The server counted exactly the prompt lengths the generator built, and every output ran to max_tokens.
    assert all(r["num_prompt_tokens"] == r["expected_prompt_tokens"] for r in records)
    assert all(r["num_output_tokens"] == r["max_tokens"] for r in records)
    assert all(r["ttft_breakdown_s"] is not None for r in records), "servelm returns its TTFT split"


def test_a_session_turn_waits_for_the_previous_turn(mixed_run):
    out, _, _ = mixed_run
    report = json.loads((out / "run.json").read_text())
    by_index = {r["index"]: r for r in report["requests"]}
    voice = [r for r in report["requests"] if r["traffic_class"] == "voice"]
    sessions = {r["session_id"] for r in voice}
    assert len(voice) > len(sessions), "the run holds a follow-up turn"
    for r in voice:
        earlier = [v for v in voice if v["session_id"] == r["session_id"] and v["index"] < r["index"]]
        if earlier:
            assert r["sent_s"] >= by_index[max(v["index"] for v in earlier)]["end_s"]


def test_compare_prints_ratios_of_two_runs(mixed_run, tmp_path: Path):
    out, _, _ = mixed_run
    report = json.loads((out / "run.json").read_text())
    report["summary"]["overall"]["ttft_s"]["p50"] *= 2  # B: twice A's median TTFT
    (tmp_path / "b.json").write_text(json.dumps(report))
    done = subprocess.run(_bench("compare", str(out / "run.json"), str(tmp_path / "b.json")), capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = next(row for row in done.stdout.splitlines() if row.startswith("| overall | TTFT p50 (ms)"))
    assert line.endswith("| 2.000 | A |")
    assert "| voice | SLO attainment |" in done.stdout


def _config(server: ServerProcess, model_dir: Path, out: Path, **overrides) -> BenchConfig:
    base = {
        "base_url": server.base_url,
        "out_dir": out,
        "tokenizer": str(model_dir),
        "prompt_scale": 0.2,
        "max_output_tokens": 8,
        "progress": False,
        "plots": False,
    }
    return BenchConfig(**{**base, **overrides})


def test_trace_replay_sends_on_the_scaled_timestamps(bench_server: ServerProcess, tiny_model_dir: Path, tmp_path: Path):
    stamps = [0, 130, 170, 600, 610, 1020, 1500, 1520, 1990, 2400, 2410, 2900]  # ms
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 5000 + t, "input_length": 40 + i, "output_length": 4,
                                         "hash_ids": [1, 2, 100 + i]}) + "\n" for i, t in enumerate(stamps)))  # fmt: skip
    config = _config(bench_server, tiny_model_dir, tmp_path, trace=trace, time_scale=0.5, trace_block_size=64, prompt_scale=1.0,
                     num_requests=len(stamps))  # fmt: skip
    report = run_once(prepare(config), config, Load("trace"), tmp_path / "out")
    records = report["requests"]
    assert [r["status"] for r in records] == ["ok"] * len(stamps)
    scheduled = [t / 1000 * 0.5 for t in stamps]
    lags = [r["sent_s"] - due for r, due in zip(records, scheduled)]
    # Never early, in the trace's order, and on time relative to the trace's own spacing (a median
    # gap of 205 ms here): sending at the unscaled stamps would lag ~0.6 s at the median, sending
    # all at once would be early. Typically ~1 ms each; the bounds are fractions of the spacing, not
    # absolute times, so a busy 2-core host (a 4.9 ms median lag was seen) does not fail it.
    typical_gap = statistics.median(b - a for a, b in zip(scheduled, scheduled[1:]))
    assert all(lag >= -0.001 for lag in lags), lags
    assert sorted(range(len(records)), key=lambda i: records[i]["sent_s"]) == list(range(len(records)))
    assert statistics.median(lags) < 0.1 * typical_gap and max(lags) < 0.5 * typical_gap, lags
    assert [r["num_prompt_tokens"] for r in records] == [40 + i for i in range(len(stamps))]


def test_closed_loop_sweep_holds_each_concurrency(bench_server: ServerProcess, tiny_model_dir: Path, tmp_path: Path):
    slos = {name: SLO(ttft_s=30.0) for name in ("voice", "code", "analytics", "chat")}
    config = _config(bench_server, tiny_model_dir, tmp_path, num_requests=6, slos=slos, plots=True,
                     weights={"chat": 1.0, "analytics": 1.0})  # fmt: skip
    sweep = run_sweep(prepare(config), config, "concurrency", [1, 3], 0.9, tmp_path)
    assert [s["load"] for s in sweep["steps"]] == [1, 3] and sweep["best"] == 3
    for step in sweep["steps"]:
        records = json.loads((tmp_path / step["dir"] / "run.json").read_text())["requests"]
        assert len(records) == 6 and all(r["status"] == "ok" for r in records)
        in_flight = max(sum(1 for o in records if o["sent_s"] <= r["sent_s"] < o["end_s"]) for r in records)
        assert in_flight <= step["load"]
    assert "Highest concurrency with every class at >= 90% SLO attainment: 3" in (tmp_path / "sweep.md").read_text()
    for plot in ("latency_vs_load.png", "goodput_vs_load.png", "ttft_breakdown_vs_load.png"):
        assert (tmp_path / plot).read_bytes().startswith(PNG_MAGIC)


def test_the_wall_clock_limit_stops_a_run_and_keeps_its_report(bench_server: ServerProcess, tiny_model_dir: Path,
                                                                tmp_path: Path):  # fmt: skip
    config = _config(bench_server, tiny_model_dir, tmp_path, num_requests=30, duration_s=1.5, weights={"chat": 1.0})
    started = time.monotonic()
    report = run_once(prepare(config), config, Load("rate", 4.0), tmp_path / "out")
    assert time.monotonic() - started < 30
    result = report["result"]
    assert result["hit_time_limit"] and not result["interrupted"]
    assert result["num_not_sent"] > 0 and len(report["requests"]) + result["num_not_sent"] == 30
    assert json.loads((tmp_path / "out" / "run.json").read_text())["result"]["hit_time_limit"]
    assert all(r["sent_s"] <= 1.5 for r in report["requests"])


def test_ctrl_c_writes_what_was_measured(bench_server: ServerProcess, tiny_model_dir: Path, tmp_path: Path):
    before = _counters(bench_server)["servelm:request_success_total"]
    command = _bench("run", "--base-url", bench_server.base_url, "--tokenizer", str(tiny_model_dir), "--rate", "3",
                     "--num-requests", "400", "--duration-s", "120", "--out", str(tmp_path), *SMALL)  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while _counters(bench_server)["servelm:request_success_total"] < before + 1 + 3:  # the warm-up, then 3
            assert process.poll() is None and time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.2)
        os.kill(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr[-3000:]
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["result"]["interrupted"] and report["result"]["num_not_sent"] > 300
    assert sum(r["status"] == "ok" for r in report["requests"]) >= 3
    assert (tmp_path / "summary.md").read_text().count("(interrupted)") == 1
