"""A sweep: the same workload (one seed) at a list of rates or concurrencies, in turn.

Every step sends the same lengths, sessions and sharing structure (and, at a rate, the same
arrival pattern, scaled), with other prompt tokens so that no step warms the server's prefix
cache for the next. The answer to "what load can I take within my SLOs": the highest load at
which every traffic class's SLO attainment reaches the target (e.g. 90%). Each step is a full run with
its own directory (run.json, summary.md, plots); the sweep adds sweep.json, sweep.md and
the load plots. Ctrl-C during a step ends the sweep after writing what was measured.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from servelm.bench.execute import BenchConfig, Load, Target, run_once
from servelm.bench.plots import plot_sweep
from servelm.bench.report import (
    BREAKDOWN_HEADER,
    SCHEMA,
    SUMMARY_HEADER,
    breakdown_rows,
    load_report,
    records_of,
    summary_rows,
    write_json,
)  # fmt: skip
from servelm.bench.stats import summarize
from servelm.bench.workload import SLO


def passes(summary: dict[str, Any], target_attainment: float) -> bool:
    """Every class's attainment reaches the target (and the step measured anything at all)."""
    classes = summary["classes"].values()
    return bool(classes) and all((c["attainment"] or 0.0) >= target_attainment - 1e-9 for c in classes)


def best_load(steps: list[dict[str, Any]], target_attainment: float) -> float | None:
    """The highest load that passes (loads above a failing one may pass again: noise; we report the highest)."""
    passing = [s["load"] for s in steps if passes(s["summary"], target_attainment)]
    return max(passing) if passing else None


def run_sweep(
    target: Target, config: BenchConfig, mode: str, loads: list[float], target_attainment: float, out_dir: Path
) -> dict[str, Any]:
    if mode not in ("rate", "concurrency"):
        raise ValueError(f"a sweep is over rates or concurrencies, not {mode!r}")
    if not 0.0 < target_attainment <= 1.0:
        raise ValueError(f"target attainment must be in (0, 1], got {target_attainment}")
    steps: list[dict[str, Any]] = []
    interrupted = False
    for step, value in enumerate(sorted(loads)):
        step_dir = out_dir / f"{mode}_{value:g}"
        # Same lengths, sessions and arrival times at every step; other tokens (salt), so that a step
        # does not find the previous step's prompts in the server's prefix cache.
        report = run_once(target, config, Load(mode, value), step_dir, salt=step)
        steps.append({"load": value, "dir": step_dir.name, "result": report["result"], "summary": report["summary"],
                      "server_metrics_delta": report["server"]["metrics_delta"]})  # fmt: skip
        if report["result"]["interrupted"]:
            interrupted = True
            break
    sweep = {
        "schema": SCHEMA,
        "kind": "sweep",
        "created_unix": time.time(),
        "config": config.to_dict(),
        "mode": mode,
        "target_attainment": target_attainment,
        "best": best_load(steps, target_attainment),
        "interrupted": interrupted,
        "steps": steps,
    }
    write_json(sweep, out_dir / "sweep.json")
    plots = plot_sweep(steps, mode, out_dir) if config.plots else []
    (out_dir / "sweep.md").write_text(sweep_markdown(sweep, plots))
    return sweep


def reanalyse_sweep(sweep: dict[str, Any], sweep_dir: Path, slos: dict[str, SLO], out_dir: Path) -> dict[str, Any]:
    """The sweep judged by other SLOs, from its steps' saved requests; writes it (and its steps) to out_dir."""
    steps = []
    for step in sweep["steps"]:
        report = load_report(sweep_dir / step["dir"] / "run.json")
        report["slos"] = {name: slo.to_dict() for name, slo in slos.items()}
        report["summary"] = summarize(records_of(report), slos, report["result"]["duration_s"]).to_dict()
        write_json(report, out_dir / step["dir"] / "run.json")
        steps.append({**step, "summary": report["summary"]})
    again = {**sweep, "steps": steps, "best": best_load(steps, sweep["target_attainment"]),
             "config": {**sweep["config"], "slos": report["slos"]}, "reanalysed_from": str(sweep_dir)}  # fmt: skip
    write_json(again, out_dir / "sweep.json")
    plots = plot_sweep(steps, again["mode"], out_dir)
    (out_dir / "sweep.md").write_text(sweep_markdown(again, plots))
    return again


def sweep_markdown(sweep: dict[str, Any], plots: list[Path] | None = None) -> str:
    unit = "req/s" if sweep["mode"] == "rate" else "concurrent requests"
    best = sweep["best"]
    target = f"{sweep['target_attainment'] * 100:g}%"
    if best is not None:
        verdict = f"**Highest {sweep['mode']} with every class at >= {target} SLO attainment: {best:g} {unit}.**"
    else:
        verdict = f"**No {sweep['mode']} tried kept every class at >= {target} SLO attainment.**"
    header = SUMMARY_HEADER.replace("| class |", f"| {sweep['mode']} | class |", 1).replace("|---|", "|---:|---|", 1)
    rows = [row for step in sweep["steps"] for row in summary_rows(step["summary"], prefix=f"{step['load']:g} | ")]
    lines = [f"# servelm bench sweep ({sweep['config'].get('profile')})", "", verdict, "", header, *rows]
    split = [row for step in sweep["steps"] for row in breakdown_rows(step["summary"], prefix=f"{step['load']:g} | ")]
    if split:
        split_header = BREAKDOWN_HEADER.replace("| class |", f"| {sweep['mode']} | class |", 1).replace(
            "|---|", "|---:|---|", 1
        )
        lines += ["", "Mean TTFT split (ms):", "", split_header, *split]
    if sweep["interrupted"]:
        lines += ["", "(interrupted: later loads were not run)"]
    lines += ["", *[f"![{p.stem}]({p.name})" for p in plots or []]]
    return "\n".join(lines).rstrip() + "\n"
