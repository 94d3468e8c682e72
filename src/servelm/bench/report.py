"""Reports: the JSON of a run (every request, for re-analysis) and its Markdown summary.

    run.json   {"schema", "kind": "run", "config", "server", "slos", "result", "summary", "requests": [...]}
    sweep.json {"schema", "kind": "sweep", "config", "mode", "target_attainment", "best", "steps": [...]}

`summary` can always be recomputed from `requests` and `slos` (stats.summarize); it is stored
so that `compare` and readers need nothing but the file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from servelm.bench.client import RequestRecord
from servelm.bench.stats import Summary
from servelm.bench.workload import SLO
from servelm.schemas.ttft import NETWORK, TTFT_COMPONENTS

SCHEMA = "servelm-bench/1"


def run_report(
    *, config: dict[str, Any], server: dict[str, Any], slos: dict[str, SLO], result: dict[str, Any],
    summary: Summary, records: list[RequestRecord],
) -> dict[str, Any]:  # fmt: skip
    return {
        "schema": SCHEMA,
        "kind": "run",
        "created_unix": time.time(),
        "config": config,
        "server": server,
        "slos": {name: slo.to_dict() for name, slo in slos.items()},
        "result": result,
        "summary": summary.to_dict(),
        "requests": [r.to_dict() for r in records],
    }


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    return path


def load_report(path: str | Path) -> dict[str, Any]:
    report = json.loads(Path(path).read_text())
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a servelm bench report (schema {report.get('schema')!r})")
    return report


def records_of(report: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(raw) for raw in report["requests"]]


def slos_of(report: dict[str, Any]) -> dict[str, SLO]:
    return {name: SLO(**raw) for name, raw in report.get("slos", {}).items()}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _met(value: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "-"}[value]


SUMMARY_HEADER = (
    "| class | SLO | sent | ok | failed | TTFT p50 / p90 / p99 (ms) | TBT p50 / p90 / p99 (ms) | TPOT p50 (ms) "
    "| E2E p90 (s) | out tok/s | attainment | goodput (req/s) | SLO met |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def summary_rows(summary: dict[str, Any], prefix: str = "") -> list[str]:
    """One Markdown table row per class and one overall (`prefix`: leading cells, for sweeps)."""
    rows = []
    for group in [*summary["classes"].values(), summary["overall"]]:
        slo = SLO(**group["slo"]).describe() if group["slo"] else "each its own"
        ttft, tbt = group["ttft_s"], group["tbt_s"]
        e2e = group["e2e_s"]["p90"]
        name = group["name"] if group["name"] != "overall" else "**overall**"
        rows.append(
            f"| {prefix}{name} | {slo} | {group['num_requests']} | {group['num_ok']} "
            f"| {group['num_errors'] + group['num_cancelled']} "
            f"| {_ms(ttft['p50'])} / {_ms(ttft['p90'])} / {_ms(ttft['p99'])} "
            f"| {_ms(tbt['p50'])} / {_ms(tbt['p90'])} / {_ms(tbt['p99'])} | {_ms(group['tpot_s']['p50'])} "
            f"| {'-' if e2e is None else f'{e2e:.2f}'} | {group['output_token_throughput']:.1f} "
            f"| {_pct(group['attainment'])} | {group['goodput']:.3f} | {_met(group['slo_met'])} |"
        )
    return rows


def breakdown_rows(summary: dict[str, Any], prefix: str = "") -> list[str]:
    rows = []
    for group in [*summary["classes"].values(), summary["overall"]]:
        split = group["ttft_breakdown_s"]
        if split:
            cells = " | ".join(_ms(split.get(c)) for c in (*TTFT_COMPONENTS, NETWORK))
            rows.append(f"| {prefix}{group['name']} | {group['num_with_breakdown']} | {cells} |")
    return rows


BREAKDOWN_HEADER = (
    "| class | requests | " + " | ".join(f"{c} (ms)" for c in (*TTFT_COMPONENTS, NETWORK)) + " |\n"
    "|---|---:|" + "---:|" * (len(TTFT_COMPONENTS) + 1)
)


def run_markdown(report: dict[str, Any], plots: list[Path] | None = None) -> str:
    config, result, summary = report["config"], report["result"], report["summary"]
    ending = " (interrupted)" if result.get("interrupted") else ""
    ending += " (hit the wall-clock limit)" if result.get("hit_time_limit") else ""
    sent = f"{len(report['requests'])} requests sent, {result['num_not_sent']} not sent"
    kind = "servelm" if report["server"].get("is_servelm") else "OpenAI-compatible"
    lines = [
        f"# servelm bench: {config.get('profile')} against {report['server'].get('model_id')}",
        "",
        f"- load: {config.get('load')}; {sent}; run {summary['duration_s']:.1f} s{ending}",
        f"- server: {report['server'].get('base_url')} ({kind})",
        "",
        SUMMARY_HEADER,
        *summary_rows(summary),
    ]
    split = breakdown_rows(summary)
    if split:
        lines += ["", "Mean TTFT split (servelm's per-request timeline; network = client TTFT less server TTFT):", "",
                  BREAKDOWN_HEADER, *split]  # fmt: skip
    delta = report["server"].get("metrics_delta")
    if delta:
        shown = {k: v for k, v in delta.items() if v}
        lines += ["", "Server counters during the run: " + ", ".join(f"`{k}` {v:g}" for k, v in shown.items())]
    lines += ["", *[f"![{p.stem}]({p.name})" for p in plots or []]]
    return "\n".join(lines).rstrip() + "\n"
