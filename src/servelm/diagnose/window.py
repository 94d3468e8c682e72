"""A captured window's numbers: what the server did between the two scrapes, and what the client saw.

    counters     end − start per label set (a label set absent at the start had not been used: 0;
                 an end below the start means the server restarted: the end alone, as Prometheus' rate())
    histograms   the same per bucket, with `_sum` and `_count`; merged over label sets on request
    gauges       mean and maximum over gauges.jsonl (without it: the end scrape alone)
    client       from bench.json: client-measured TTFT, the network component, rate and lengths

A metric the server does not export is absent (None), never 0: an old server without a new
metric reads "unknown", not "nothing happened". A family exported with no samples is 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servelm.diagnose.capture import (
    BENCH_FILE,
    BENCH_SCHEMA,
    GAUGES_FILE,
    METRICS_END_FILE,
    METRICS_START_FILE,
    WINDOW_FILE,
)
from servelm.diagnose.prom import Family, gauge_totals, parse_text
from servelm.schemas.ttft import NETWORK

LabelSet = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, `le` excluded


@dataclass(frozen=True)
class Histogram:
    """Observations of one window: cumulative counts per upper bound (ascending, +Inf last)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    count: float
    sum: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear inside the bucket holding rank q·count; None when empty.

        bounds      b0        b1        b2 ... +Inf
        cumulative  c0        c1        c2 ...  count
        rank r in (c0, c1]  →  b0 + (b1 − b0) · (r − c0) / (c1 − c0)     (the first bucket starts at 0)
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative):
            if cumulative >= rank and cumulative > lower_count:
                if math.isinf(bound):
                    return lower_bound  # above the last finite bound: its bound is all we know
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (cumulative - lower_count)
            lower_bound, lower_count = bound, cumulative
        return lower_bound

    def merged(self, other: Histogram) -> Histogram:
        if other.bounds != self.bounds:
            raise ValueError(f"cannot merge histograms with different buckets: {self.bounds} vs {other.bounds}")
        cumulative = tuple(a + b for a, b in zip(self.cumulative, other.cumulative))
        return Histogram(self.bounds, cumulative, self.count + other.count, self.sum + other.sum)


@dataclass(frozen=True)
class GaugeSummary:
    mean: float
    max: float
    num_samples: int


@dataclass(frozen=True)
class ClientSide:
    """bench.json's overall summary: what the load generator measured."""

    ttft_s: dict[str, float | None]  # count, mean, p50, p90, p95, p99 (stats.distribution)
    tbt_s: dict[str, float | None]  # the gaps between a stream's tokens as the client read them
    network_s: float | None  # mean client TTFT less the server's, over requests with servelm's breakdown
    request_rate: float  # successful requests / s
    arrival_rate: float | None  # requests sent / s, finished or not (None: an older report)
    prompt_tokens_per_request: float | None
    output_tokens_per_request: float | None
    class_ttft_s: dict[str, dict[str, float | None]]  # per traffic class


@dataclass(frozen=True)
class Window:
    label: str
    source: str
    start_unix: float
    end_unix: float
    counters: dict[str, dict[LabelSet, float]]  # family name (no `_total`) → label set → delta
    histograms: dict[str, dict[LabelSet, Histogram]]
    gauges: dict[str, GaugeSummary]
    client: ClientSide | None

    @property
    def duration_s(self) -> float:
        return max(self.end_unix - self.start_unix, 1e-9)

    def has(self, name: str) -> bool:
        return name in self.counters or name in self.histograms or name in self.gauges

    def counter(self, name: str, **where: str) -> float | None:
        """The delta summed over the label sets matching `where` (e.g. component="queue"); None if not exported."""
        series = self.counters.get(name)
        if series is None:
            return None
        return sum(value for labels, value in series.items() if _matches(labels, where))

    def counter_by(self, name: str, label: str) -> dict[str, float] | None:
        """The delta per value of `label` (summed over the other labels)."""
        series = self.counters.get(name)
        if series is None:
            return None
        out: dict[str, float] = {}
        for labels, value in series.items():
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value
        return out

    def rate(self, name: str, **where: str) -> float | None:
        total = self.counter(name, **where)
        return None if total is None else total / self.duration_s

    def histogram(self, name: str, **where: str) -> Histogram | None:
        """Merged over the label sets matching `where`; None if not exported or nothing matched."""
        merged: Histogram | None = None
        for labels, histogram in self.histograms.get(name, {}).items():
            if _matches(labels, where):
                merged = histogram if merged is None else merged.merged(histogram)
        return merged

    def label_values(self, name: str, label: str) -> list[str]:
        """Values `label` takes in a histogram's label sets, sorted (e.g. the SLO classes seen)."""
        series = self.histograms.get(name, {})
        return sorted({dict(labels)[label] for labels in series if label in dict(labels)})

    def gauge(self, name: str) -> GaugeSummary | None:
        return self.gauges.get(name)


def _matches(labels: LabelSet, where: dict[str, str]) -> bool:
    as_dict = dict(labels)
    return all(as_dict.get(key) == value for key, value in where.items())


def read_window(directory: Path) -> Window:
    """A window directory (capture.py's layout) → its numbers; raises ValueError naming a missing or bad file."""
    directory = Path(directory)
    for needed in (WINDOW_FILE, METRICS_START_FILE, METRICS_END_FILE):
        if not (directory / needed).is_file():
            raise ValueError(f"{directory} is not a captured window: {needed} is missing")
    meta = json.loads((directory / WINDOW_FILE).read_text())
    start = parse_text((directory / METRICS_START_FILE).read_text())
    end = parse_text((directory / METRICS_END_FILE).read_text())
    gauges_path = directory / GAUGES_FILE
    samples = _read_jsonl(gauges_path) if gauges_path.is_file() else []
    bench_path = directory / BENCH_FILE
    return Window(
        label=str(meta.get("label", directory.name)),
        source=str(meta.get("source", "")),
        start_unix=float(meta["start_unix"]),
        end_unix=float(meta["end_unix"]),
        counters=counter_deltas(start, end),
        histograms=histogram_deltas(start, end),
        gauges=summarize_gauges(samples or [gauge_totals(end)]),
        client=client_side(json.loads(bench_path.read_text())) if bench_path.is_file() else None,
    )


def counter_deltas(start: dict[str, Family], end: dict[str, Family]) -> dict[str, dict[LabelSet, float]]:
    out: dict[str, dict[LabelSet, float]] = {}
    for name, family in end.items():
        if family.type != "counter":
            continue
        before = _values(start.get(name), "_total")
        out[name] = {
            labels: _delta(before.get(labels, 0.0), value) for labels, value in _values(family, "_total").items()
        }
    return out


def histogram_deltas(start: dict[str, Family], end: dict[str, Family]) -> dict[str, dict[LabelSet, Histogram]]:
    out: dict[str, dict[LabelSet, Histogram]] = {}
    for name, family in end.items():
        if family.type == "histogram":
            before = _histograms(start.get(name))
            out[name] = {
                labels: _histogram_delta(before.get(labels), after) for labels, after in _histograms(family).items()
            }
    return out


def summarize_gauges(samples: list[dict[str, float]]) -> dict[str, GaugeSummary]:
    values: dict[str, list[float]] = {}
    for sample in samples:
        for name, value in sample.items():
            if name != "t":
                values.setdefault(name, []).append(float(value))
    return {name: GaugeSummary(sum(v) / len(v), max(v), len(v)) for name, v in values.items()}


def client_side(report: dict[str, Any]) -> ClientSide:
    if report.get("schema") != BENCH_SCHEMA:
        raise ValueError(f"bench.json is not a servelm bench report: schema {report.get('schema')!r}")
    overall = report["summary"]["overall"]
    num_ok = overall["num_ok"]
    breakdown = overall.get("ttft_breakdown_s")
    return ClientSide(
        ttft_s=overall["ttft_s"],
        tbt_s=overall.get("tbt_s") or {},
        network_s=breakdown.get(NETWORK) if breakdown else None,
        request_rate=overall["request_throughput"],
        arrival_rate=overall["num_requests"] / report["summary"]["duration_s"] if report["summary"].get("duration_s") else None,
        prompt_tokens_per_request=overall["num_prompt_tokens"] / num_ok if num_ok else None,
        output_tokens_per_request=overall["num_output_tokens"] / num_ok if num_ok else None,
        class_ttft_s={name: group["ttft_s"] for name, group in report["summary"].get("classes", {}).items()},
    )


def _read_jsonl(path: Path) -> list[dict[str, float]]:
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
    return lines


def _delta(before: float, after: float) -> float:
    return after if after < before else after - before  # a reset: the server restarted inside the window


def _values(family: Family | None, suffix: str) -> dict[LabelSet, float]:
    if family is None:
        return {}
    return {s.labels: s.value for s in family.samples if s.name.endswith(suffix)}


def _histograms(family: Family | None) -> dict[LabelSet, Histogram]:
    """One Histogram per label set (`le` taken out of the labels into the bounds)."""
    if family is None:
        return {}
    buckets: dict[LabelSet, list[tuple[float, float]]] = {}
    sums: dict[LabelSet, float] = {}
    counts: dict[LabelSet, float] = {}
    for sample in family.samples:
        labels = tuple(pair for pair in sample.labels if pair[0] != "le")
        if sample.name.endswith("_bucket"):
            bound = float(dict(sample.labels)["le"])
            buckets.setdefault(labels, []).append((bound, sample.value))
        elif sample.name.endswith("_sum"):
            sums[labels] = sample.value
        elif sample.name.endswith("_count"):
            counts[labels] = sample.value
    out = {}
    for labels, pairs in buckets.items():
        pairs.sort()
        out[labels] = Histogram(
            tuple(b for b, _ in pairs), tuple(c for _, c in pairs), counts.get(labels, 0.0), sums.get(labels, 0.0)
        )
    return out


def _histogram_delta(before: Histogram | None, after: Histogram) -> Histogram:
    if before is None or before.bounds != after.bounds or after.count < before.count:
        return after  # new in the window, or the server restarted
    cumulative = tuple(a - b for a, b in zip(after.cumulative, before.cumulative))
    return Histogram(after.bounds, cumulative, after.count - before.count, after.sum - before.sum)
