"""The scenario suite: its registry, and one quick scenario end to end against a real server it
starts itself (tiny model): both windows recorded in capture.py's layout, then diagnosed."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from servelm.bench.scenario_run import ScenarioOptions, run_scenario
from servelm.bench.scenarios import SCENARIOS, get_scenario
from servelm.server.launcher import launch_server

CAUSES = {"long-docs": "scheduler", "kv-pressure": "kv_cache", "slow-readers": "output",
          "network-delay": "network", "long-histories": "frontend"}  # fmt: skip
WINDOW_FILES = {"window.json", "metrics_start.prom", "metrics_end.prom", "gauges.jsonl", "bench.json"}


def test_the_registry_names_each_scenario_and_its_cause():
    assert {name: s.expected_cause for name, s in SCENARIOS.items()} == CAUSES
    for scenario in SCENARIOS.values():
        assert scenario.baseline != scenario.today, f"{scenario.name}: the today window injects nothing"
        for quick in (False, True):
            assert scenario.size(quick).num_requests >= 10
    with pytest.raises(ValueError, match="long-docs"):
        get_scenario("ttft-tripled")


def test_quick_network_delay_scenario_end_to_end(tiny_model_dir: Path, tmp_path: Path):
    started: list[list[str]] = []

    @contextlib.contextmanager
    def launcher(model: str | None, args: list[str]) -> Iterator[str]:
        started.append(args)
        with launch_server(model, args) as server:
            yield server.base_url

    scenario = get_scenario("network-delay")
    options = ScenarioOptions(out_dir=tmp_path / "run", quick=True, model=str(tiny_model_dir), seconds=6.0,
                              progress=False)  # fmt: skip
    result = run_scenario(scenario, options, launcher)

    assert started == [list(scenario.quick_server_args)], "one server for both windows"
    for label in ("baseline", "today"):
        window = tmp_path / "run" / label
        assert WINDOW_FILES <= {p.name for p in window.iterdir()}, label
        meta = json.loads((window / "window.json").read_text())
        assert meta["label"] == label and meta["end_unix"] > meta["start_unix"]
        bench = json.loads((window / "bench.json").read_text())
        assert bench["schema"] == "servelm-bench/1" and len(bench["requests"]) == 24
        assert all(r["status"] == "ok" for r in bench["requests"]), label
    baseline = json.loads((tmp_path / "run/baseline/bench.json").read_text())["summary"]["overall"]
    today = json.loads((tmp_path / "run/today/bench.json").read_text())["summary"]["overall"]
    assert today["ttft_s"]["p50"] > baseline["ttft_s"]["p50"] + 0.25, "two 150 ms one-way delays on every request"
    assert (tmp_path / "run/diagnosis.json").exists() and result.top_cause is not None
    assert result.top_cause == "network", (tmp_path / "run/diagnosis.txt").read_text()
