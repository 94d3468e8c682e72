"""PNG plots of a run and of a sweep (matplotlib's object API: no pyplot, no global state).

run    cdf.png               TTFT and TBT CDFs per class
       throughput.png        output tokens/s over the run, stacked by class
       ttft_breakdown.png    mean TTFT split per class (servelm servers only)
sweep  latency_vs_load.png   TTFT and TBT p50/p90/p99 against the rate (or concurrency), per class
       goodput_vs_load.png   SLO attainment and goodput against the load, per class
       ttft_breakdown_vs_load.png   the overall mean TTFT split at each load
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from servelm.bench.client import RequestRecord
from servelm.schemas.ttft import NETWORK, TTFT_COMPONENTS

_COLORS = {"voice": "tab:blue", "code": "tab:orange", "analytics": "tab:green", "chat": "tab:red",
           "trace": "tab:purple", "overall": "black"}  # fmt: skip
_SPLIT_COLORS = ("tab:gray", "tab:orange", "tab:blue", "tab:red", "tab:green", "tab:purple")


def _color(name: str) -> str:
    return _COLORS.get(name, "tab:brown")


def _classes(records: list[RequestRecord]) -> list[str]:
    return list(dict.fromkeys(r.traffic_class for r in records))


def plot_cdfs(records: list[RequestRecord], path: Path) -> Path | None:
    ok = [r for r in records if r.ok]
    if not ok:
        return None
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ttft_ax, tbt_ax = fig.subplots(1, 2)
    for name in _classes(ok):
        mine = [r for r in ok if r.traffic_class == name]
        _cdf(ttft_ax, [r.ttft_s * 1000 for r in mine if r.ttft_s is not None], name)
        _cdf(tbt_ax, [gap * 1000 for r in mine for gap in r.itl_s], name)
    for ax, title in ((ttft_ax, "TTFT"), (tbt_ax, "TBT (inter-token gaps)")):
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests" if ax is ttft_ax else "fraction of gaps")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.savefig(path, dpi=110)
    return path


def _cdf(ax: Any, values: list[float], name: str) -> None:
    if not values:
        return
    data = np.sort(np.asarray(values))
    ax.step(
        data, np.arange(1, data.size + 1) / data.size, where="post", label=f"{name} ({data.size})", color=_color(name)
    )
    if data[0] > 0 and data[-1] / data[0] > 50:
        ax.set_xscale("log")


def plot_throughput(records: list[RequestRecord], duration_s: float, path: Path) -> Path | None:
    """Output tokens/s in time bins; a chunk counts as the request's tokens divided over its chunks."""
    ok = [r for r in records if r.ok and r.chunk_times_s]
    if not ok or duration_s <= 0:
        return None
    width = max(duration_s / 60.0, 0.5)
    edges = np.arange(0.0, duration_s + width, width)
    names = _classes(ok)
    series = []
    for name in names:
        times, weights = [], []
        for r in ok:
            if r.traffic_class == name:
                per_chunk = (r.num_output_tokens or len(r.chunk_times_s)) / len(r.chunk_times_s)
                times += r.chunk_times_s
                weights += [per_chunk] * len(r.chunk_times_s)
        counts, _ = np.histogram(times, bins=edges, weights=weights)
        series.append(counts / width)
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.subplots()
    bottom = np.zeros(len(edges) - 1)
    for name, values in zip(names, series):
        ax.bar(edges[:-1], values, width=width, align="edge", bottom=bottom, label=name, color=_color(name), alpha=0.85)
        bottom += values
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Output throughput over time ({width:.1f} s bins)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110)
    return path


def _stacked_split(ax: Any, labels: list[str], splits: list[dict[str, float]]) -> None:
    positions = np.arange(len(labels))  # numeric: labels like "0.5" must stay category names
    bottoms = np.zeros(len(labels))
    for component, color in zip((*TTFT_COMPONENTS, NETWORK), _SPLIT_COLORS):
        values = np.array([max(split.get(component, 0.0), 0.0) * 1000 for split in splits])
        ax.bar(positions, values, bottom=bottoms, label=component, color=color)
        bottoms += values
    ax.set_xticks(positions, labels)
    ax.set_ylabel("mean TTFT (ms)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def plot_breakdown(summary: dict[str, Any], path: Path) -> Path | None:
    groups = [g for g in [*summary["classes"].values(), summary["overall"]] if g["ttft_breakdown_s"]]
    if not groups:
        return None
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    _stacked_split(ax, [g["name"] for g in groups], [g["ttft_breakdown_s"] for g in groups])
    ax.set_title("Where TTFT goes, per class (servelm timeline)")
    fig.savefig(path, dpi=110)
    return path


def plot_run(records: list[RequestRecord], summary: dict[str, Any], out_dir: Path) -> list[Path]:
    made = [
        plot_cdfs(records, out_dir / "cdf.png"),
        plot_throughput(records, summary["duration_s"], out_dir / "throughput.png"),
        plot_breakdown(summary, out_dir / "ttft_breakdown.png"),
    ]
    return [p for p in made if p is not None]


def plot_sweep(steps: list[dict[str, Any]], mode: str, out_dir: Path) -> list[Path]:
    """`steps`: [{"load": value, "summary": summary dict}, ...] in load order."""
    if not steps:
        return []
    loads = [s["load"] for s in steps]
    names = list(dict.fromkeys(n for s in steps for n in s["summary"]["classes"]))
    xlabel = "offered rate (req/s)" if mode == "rate" else "concurrency"
    made = [_latency_vs_load(steps, loads, names, xlabel, out_dir / "latency_vs_load.png"),
            _goodput_vs_load(steps, loads, names, xlabel, out_dir / "goodput_vs_load.png")]  # fmt: skip
    splits = [(str(s["load"]), s["summary"]["overall"]["ttft_breakdown_s"]) for s in steps]
    if any(split for _, split in splits):
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        ax = fig.subplots()
        _stacked_split(ax, [label for label, _ in splits], [split or {} for _, split in splits])
        ax.set_xlabel(xlabel)
        ax.set_title("Where TTFT goes as the load grows (all classes)")
        fig.savefig(out_dir / "ttft_breakdown_vs_load.png", dpi=110)
        made.append(out_dir / "ttft_breakdown_vs_load.png")
    return made


def _group(step: dict[str, Any], name: str) -> dict[str, Any] | None:
    return step["summary"]["classes"].get(name)


def _latency_vs_load(steps: list[dict], loads: list[float], names: list[str], xlabel: str, path: Path) -> Path:
    fig = Figure(figsize=(4 * len(names), 7), layout="constrained")
    axes = np.asarray(fig.subplots(2, len(names), squeeze=False))
    for col, name in enumerate(names):
        for row, metric in enumerate(("ttft_s", "tbt_s")):
            ax = axes[row, col]
            for q, style in (("p50", ":"), ("p90", "-"), ("p99", "--")):
                values = [(_group(s, name) or {}).get(metric, {}).get(q) for s in steps]
                ax.plot(loads, [np.nan if v is None else v * 1000 for v in values], style, marker="o",
                        color=_color(name), label=q)  # fmt: skip
            slo = next((g["slo"] for s in steps if (g := _group(s, name)) and g["slo"]), None)
            bound = (slo or {}).get("ttft_s" if metric == "ttft_s" else "tbt_s")
            if bound:
                ax.axhline(bound * 1000, color="gray", linewidth=1, label="SLO")
            ax.set_title(f"{name}: {'TTFT' if metric == 'ttft_s' else 'TBT'}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("ms")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def _goodput_vs_load(steps: list[dict], loads: list[float], names: list[str], xlabel: str, path: Path) -> Path:
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    attain_ax, good_ax = fig.subplots(1, 2)
    for name in [*names, "overall"]:
        groups = [s["summary"]["overall"] if name == "overall" else _group(s, name) for s in steps]
        attainment = [np.nan if not g or g["attainment"] is None else g["attainment"] * 100 for g in groups]
        goodput = [np.nan if not g else g["goodput"] for g in groups]
        attain_ax.plot(loads, attainment, marker="o", color=_color(name), label=name)
        good_ax.plot(loads, goodput, marker="o", color=_color(name), label=name)
    attain_ax.set_ylabel("SLO attainment (%)")
    attain_ax.set_ylim(0, 105)
    good_ax.set_ylabel("goodput (req/s meeting SLO)")
    for ax in (attain_ax, good_ax):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path
