"""The cause rules on hand-written windows: each cause, load vs scheduler, none, and absent metrics.

Each window is written as capture.py would (window.json, the two scrapes, gauges.jsonl, maybe
bench.json); the start scrape is empty, so the end scrape's values are the window's deltas.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servelm.diagnose.causes import Noise, diagnose
from servelm.diagnose.report import to_json, to_text
from servelm.diagnose.sources import load_signals
from servelm.diagnose.window import Histogram, read_window

BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 50.0, 100.0, 500.0, 1000.0, 5000.0)
M = 'model_name="m",slo_class="interactive"'
BASE = {
    "requests": 100, "ingress": 0.002, "queue": 0.005, "prefill": 0.02, "preemption": 0.0, "output": 0.003,
    "prompt_tokens": 100, "long_prompts": 0, "generation_tokens": 20, "step_s": 0.01, "step_tokens": 50,
    "preemptions": 0, "hits": 5000, "queries": 10000, "evicted": 0, "kv_usage": 0.3, "waiting": 0.5,
    "outputs_queued": 0.0, "loop_lag": 0.001, "network": None, "itl": 0.03, "client_tbt": 0.03,
    "evicted_misses": None,  # prompt tokens missed on evicted blocks (None: an older server, not exported)
}  # fmt: skip


def _histogram(name: str, labels: str, values: list[float]) -> list[str]:
    lines = [f"# TYPE {name} histogram"]
    for bound in (*BOUNDS, float("inf")):
        le = "+Inf" if bound == float("inf") else repr(bound)
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {sum(1 for v in values if v <= bound)}')
    return lines + [f"{name}_count{{{labels}}} {len(values)}", f"{name}_sum{{{labels}}} {sum(values)}"]


def _counter(name: str, value: float, labels: str = 'model_name="m"') -> list[str]:
    return [f"# TYPE {name}_total counter", f"{name}_total{{{labels}}} {value}"]  # prometheus_client's form


def write_window(directory: Path, label: str, **changes: float | None) -> Path:
    """A 10 s window of BASE with `changes`: every request sees the same TTFT split."""
    w = {**BASE, **changes}
    n, n_long = int(w["requests"]), int(w["long_prompts"])
    prompts = [float(w["prompt_tokens"])] * (n - n_long) + [4000.0] * n_long
    components = ("ingress", "queue", "prefill", "preemption", "output")
    ttft = sum(float(w[c]) for c in components)
    lines = _histogram("servelm:time_to_first_token_seconds", M, [ttft] * n)
    for c in components:
        lines += _histogram("servelm:ttft_component_seconds", f'component="{c}",{M}', [float(w[c])] * n)
    lines += _histogram("servelm:request_prompt_tokens", M, prompts)
    lines += _histogram("servelm:engine_step_seconds", 'model_name="m"', [float(w["step_s"])] * 50)
    lines += _histogram("servelm:iteration_tokens", 'model_name="m"', [float(w["step_tokens"])] * 50)
    lines += _histogram("servelm:api_event_loop_lag_seconds", 'model_name="m"', [float(w["loop_lag"])] * 20)
    lines += _histogram("servelm:inter_token_latency_seconds", M, [float(w["itl"])] * 10 * n)
    lines += _counter("servelm:request_success", n, f'finished_reason="length",{M}')
    lines += _counter("servelm:prompt_tokens", sum(prompts), M)
    lines += _counter("servelm:generation_tokens", n * float(w["generation_tokens"]), M)
    lines += _counter("servelm:num_preemptions", float(w["preemptions"]))
    lines += _counter("servelm:prefix_cache_hits", float(w["hits"])) + _counter(
        "servelm:prefix_cache_queries", float(w["queries"])
    )
    lines += _counter("servelm:prefix_cache_evicted_blocks", float(w["evicted"]), 'model_name="m",tenant="docs"')
    if w["evicted_misses"] is not None:
        lines += _counter("servelm:prefix_cache_evicted_misses", float(w["evicted_misses"]))
    directory.mkdir(parents=True)
    (directory / "metrics_start.prom").write_text("")
    (directory / "metrics_end.prom").write_text("\n".join(lines) + "\n")
    (directory / "window.json").write_text(
        json.dumps({"label": label, "source": "test", "start_unix": 0.0, "end_unix": 10.0})
    )
    gauges = {"servelm:num_requests_waiting": w["waiting"], "servelm:kv_cache_usage_perc": w["kv_usage"],
              "servelm:num_outputs_queued_in_api": w["outputs_queued"]}  # fmt: skip
    (directory / "gauges.jsonl").write_text("".join(json.dumps({"t": t, **gauges}) + "\n" for t in (0.0, 5.0, 10.0)))
    if w["network"] is not None:
        overall = {
            "num_ok": n, "num_requests": n + int(w.get("unfinished", 0)), "num_prompt_tokens": sum(prompts), "num_output_tokens": n * 20, "request_throughput": n / 10,
            "ttft_s": {"mean": ttft + float(w["network"]), "p90": ttft + float(w["network"])},
            "ttft_breakdown_s": {"network": w["network"]},
            "tbt_s": {"mean": w["client_tbt"], "p90": w["client_tbt"]},
        }  # fmt: skip
        (directory / "bench.json").write_text(
            json.dumps({"schema": "servelm-bench/1", "summary": {"overall": overall, "duration_s": 10.0}})
        )
    return directory


def _diagnose(tmp_path: Path, baseline: dict, current: dict) -> dict:
    base = load_signals(write_window(tmp_path / "baseline", "baseline", **baseline))
    cur = load_signals(write_window(tmp_path / "current", "current", **current))
    diagnosis = diagnose(base, cur)
    assert to_text(diagnosis).count("Top cause: " + diagnosis.top_cause) == 1
    return to_json(diagnosis)


@pytest.mark.parametrize(
    ("current", "cause"),
    [
        # a few long documents among the same short requests: the median prompt holds, steps grow
        ({"queue": 0.3, "prefill": 0.2, "long_prompts": 10, "step_s": 0.1, "step_tokens": 2000}, "scheduler"),
        # twice the requests, same sizes: the same queue growth is load
        ({"queue": 0.3, "prefill": 0.2, "requests": 200}, "load"),
        # every prompt twice as long
        ({"queue": 0.3, "prefill": 0.2, "prompt_tokens": 200}, "load"),
        ({"preemption": 0.4, "queue": 0.1, "preemptions": 80, "kv_usage": 0.97}, "kv_cache"),
        # prefill grew because cached prefixes were evicted: recompute (a server without the
        # evicted-miss count: inferred from the hit rate falling with evictions up)
        ({"prefill": 0.3, "hits": 1000, "evicted": 500}, "kv_cache"),
        ({"output": 0.5, "outputs_queued": 300.0}, "output"),
        # the same traffic, streams not read: their backlog's CPU slows the prefills (2 cores)
        ({"queue": 0.1, "prefill": 0.7, "outputs_queued": 300.0, "step_s": 0.02}, "output"),
        ({"network": 0.4}, "network"),
        ({"ingress": 0.3, "loop_lag": 0.05}, "frontend"),
        ({"queue": 0.012}, "none"),  # +7 ms: noise
    ],
)
def test_each_cause(tmp_path: Path, current: dict, cause: str):
    baseline = {"network": 0.001} if "network" in current else {}
    report = _diagnose(tmp_path, baseline, current)
    assert report["top_cause"] == cause, json.dumps(report["causes"], indent=1)
    assert report["ttft"]["grew"] is (cause != "none")
    top = report["causes"][0]
    if cause != "none":
        assert top["explains_s"] > 0.8 * report["ttft"]["growth_s"] and top["knob"]
        assert all(e.keys() == {"signal", "baseline", "current", "ratio"} for e in top["evidence"])


@pytest.mark.parametrize(
    ("current", "cause"),
    [
        # slow readers: the API takes their outputs late, outputs pile up; steps as before
        ({"itl": 0.5, "outputs_queued": 300.0}, "output"),
        # ...and their backlog's CPU slows the steps too (2 cores), by far less than the gaps grew
        ({"itl": 0.2, "client_tbt": 0.2, "network": 0.001, "step_s": 0.016, "outputs_queued": 300.0}, "output"),
        # long prompts' chunks AND a backlog: the steps grew as much as the gaps, so the steps it is
        ({"itl": 0.2, "step_s": 0.2, "step_tokens": 2000, "outputs_queued": 300.0}, "scheduler"),
        # steps got longer (long prompts' chunks in them): every stream's gaps with them
        ({"itl": 0.2, "step_s": 0.2, "step_tokens": 2000}, "scheduler"),
        ({"itl": 0.2, "loop_lag": 0.1}, "frontend"),
        # the client's gaps grew, the server kept pace: the path between them
        ({"client_tbt": 0.3, "network": 0.001}, "network"),
        # decode steps grew by less than x1.5 (rows attending over longer histories) but make up most
        # of the server's own gap growth, which the client saw too: the steps, not the path
        ({"itl": 0.045, "client_tbt": 0.045, "network": 0.001, "step_s": 0.036}, "scheduler"),
        # the server's gaps grew with the client's, the steps did not: the streaming path, not the network
        ({"itl": 0.3, "client_tbt": 0.3, "network": 0.001}, "output"),
        ({"itl": 0.035}, "none"),  # +5 ms: noise
    ],
)
def test_when_ttft_holds_the_time_between_tokens_is_explained(tmp_path: Path, current: dict, cause: str):
    baseline = {"network": 0.001} if "network" in current else {}
    if current.get("step_s") == 0.036:  # a step of 25 ms: the long-histories scenario's on Zen 3
        baseline["step_s"] = 0.025
    report = _diagnose(tmp_path, baseline, current)
    assert report["ttft"]["grew"] is False
    assert report["top_cause"] == cause, json.dumps(report["causes"], indent=1)
    if cause != "none":
        assert report["latency"] == "tbt" and report["causes"][0]["components"] == ["tbt"]
        grew = current.get("client_tbt", current.get("itl", BASE["itl"])) - BASE["itl"]
        assert report["causes"][0]["explains_s"] == pytest.approx(grew, rel=0.05) and report["causes"][0]["knob"]


@pytest.mark.parametrize(
    ("baseline_misses", "current", "cause"),
    [
        # long unique documents join: the token hit rate falls (they hit nothing) and evictions
        # rise (the finished documents' blocks), but no prompt missed a block it once had
        (0, {"prefill": 0.3, "queries": 40000, "hits": 5000, "evicted": 500, "evicted_misses": 0,
             "long_prompts": 10, "step_s": 0.1, "step_tokens": 2000}, "scheduler"),
        # the same, and the others' prefixes were evicted under them: 2,000 of 7,000 reusable tokens lost
        (0, {"prefill": 0.3, "queries": 40000, "hits": 5000, "evicted": 500, "evicted_misses": 2000,
             "long_prompts": 10, "step_s": 0.1, "step_tokens": 2000}, "kv_cache"),
        # losses the baseline already had are not today's cause
        (1000, {"prefill": 0.3, "hits": 4500, "evicted": 500, "evicted_misses": 1100}, "scheduler"),
    ],
)  # fmt: skip
def test_prefixes_lost_is_measured_by_misses_on_evicted_blocks(tmp_path: Path, baseline_misses: int, current: dict,
                                                               cause: str):  # fmt: skip
    report = _diagnose(tmp_path, {"evicted_misses": baseline_misses}, current)
    assert report["top_cause"] == cause, json.dumps(report["causes"], indent=1)


def test_longer_prompts_served_from_the_prefix_cache_are_not_more_load(tmp_path: Path):
    """Long histories re-sent: prompts 4x, all of the growth prefix-cache hits (no more prefill work),
    while rendering and tokenizing them costs the API process."""
    cached = {"ingress": 0.2, "queue": 0.05, "prompt_tokens": 400, "hits": 35000, "queries": 40000}
    report = _diagnose(tmp_path / "cached", {}, cached)
    assert [c["name"] for c in report["causes"]] == ["frontend", "scheduler"]
    computed = {**cached, "hits": 5000}  # the same prompts, computed: that is more work
    assert [c["name"] for c in _diagnose(tmp_path / "computed", {}, computed)["causes"]] == ["frontend", "load"]


def test_requests_left_waiting_at_the_windows_end_count_by_littles_law(tmp_path: Path):
    """An overloaded window looks fast in the histograms (its slow requests never got a first token
    in it); the waiting gauge and the client's arrival count tell the truth."""
    overloaded = {"network": 0.001, "waiting": 20.0, "unfinished": 60, "step_s": 0.1, "step_tokens": 2000}
    report = _diagnose(tmp_path, {"network": 0.001}, overloaded)
    # 160 arrivals in 10 s with 20 waiting on average: 1.25 s of queue per request, not 5 ms.
    assert report["components"]["queue"]["current"] == pytest.approx(1.25)
    assert report["top_cause"] == "scheduler" and report["ttft"]["grew"]
    assert any("Little's law" in note for note in report["notes"])


def test_growth_split_between_causes_ranks_the_larger_first(tmp_path: Path):
    report = _diagnose(tmp_path, {}, {"ingress": 0.1, "output": 0.3, "outputs_queued": 40.0})
    assert [c["name"] for c in report["causes"]] == ["output", "frontend"]
    assert report["causes"][0]["explains_s"] == pytest.approx(0.297)
    assert report["causes"][1]["explains_s"] == pytest.approx(0.098)


def test_absent_metrics_are_none_not_zero(tmp_path: Path):
    report = _diagnose(tmp_path, {}, {"queue": 0.3})
    signals = report["signals"]
    assert signals["partial_prefills_mean"]["current"] is None, "not exported by this server"
    assert signals["preemptions_per_s"]["current"] == 0.0, "exported, nothing happened"
    assert signals["output_backlog_mean"]["current"] is None
    assert report["components"]["network"]["current"] is None, "no bench.json"
    assert report["prefix_evictions_by_tenant"]["current"] == {"docs": 0.0}
    assert signals["request_rate"]["current"] == pytest.approx(10.0)
    assert signals["prefix_hit_rate"]["current"] == pytest.approx(0.5)
    assert signals["kv_usage_mean"]["current"] == pytest.approx(0.3)
    assert report["classes"]["interactive"]["current"]["ttft_mean_s"] == pytest.approx(0.325)


def test_histogram_quantiles_interpolate_inside_buckets(tmp_path: Path):
    hist = Histogram((1.0, 2.0, 4.0, float("inf")), (10.0, 30.0, 40.0, 40.0), 40.0, 70.0)
    assert hist.mean == pytest.approx(1.75)
    assert hist.quantile(0.25) == pytest.approx(1.0)  # rank 10: the top of the first bucket
    assert hist.quantile(0.5) == pytest.approx(1.5)  # rank 20: half way through (1, 2]
    assert hist.quantile(0.875) == pytest.approx(3.0)  # rank 35: half way through (2, 4]
    assert Histogram((1.0, float("inf")), (0.0, 5.0), 5.0, 50.0).quantile(0.9) == 1.0, "+Inf: the last finite bound"
    assert Histogram((1.0, float("inf")), (0.0, 0.0), 0.0, 0.0).quantile(0.5) is None
    with pytest.raises(ValueError, match="quantile"):
        hist.quantile(1.5)
    window = read_window(write_window(tmp_path / "w", "w", long_prompts=50))
    prompts = window.histogram("servelm:request_prompt_tokens")
    assert prompts is not None and prompts.count == 100 and prompts.mean == pytest.approx(2050.0)
    assert window.counter("servelm:ttft_component_seconds") is None, "a histogram, not a counter"
    assert window.counter_by("servelm:request_success", "slo_class") == {"interactive": 100.0}


def _log_line(received: float, queue_ms: float, prompt_tokens: int = 20) -> str:
    split = {"ingress": 1.0, "queue": queue_ms, "prefill": 5.0, "preemption": 0.0, "output": 1.0}
    split["ttft"] = sum(split.values())
    timeline = {"received_unix": received, "choices": [{"num_preemptions": 0}], "ttft_breakdown_ms": split}
    record = {"priority": 0, "prompt_tokens": prompt_tokens, "completion_tokens": 4, "timeline": timeline}
    return json.dumps(record)


def test_request_logs_are_windows_too(tmp_path: Path):
    noise = "2025-01-01 INFO servelm.server: started\n{not json\n"
    base, cur = tmp_path / "base.log", tmp_path / "cur.log"
    base.write_text(noise + "\n".join(_log_line(100 + i * 0.1, 2.0) for i in range(20)) + "\n")
    cur.write_text(noise + "\n".join(_log_line(200 + i * 0.1, 400.0) for i in range(20)) + "\n")
    diagnosis = diagnose(load_signals(base), load_signals(cur), Noise())
    assert diagnosis.top_cause == "scheduler"
    assert diagnosis.current.values["request_rate"] == pytest.approx(10.0)
    assert diagnosis.causes[0].explains_s == pytest.approx(0.398)
    with pytest.raises(ValueError, match="no request lines"):
        load_signals(tmp_path / "empty.log") if (tmp_path / "empty.log").write_text(noise) else None
    with pytest.raises(ValueError, match="does not exist"):
        load_signals(tmp_path / "missing")
