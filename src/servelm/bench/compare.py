"""`servelm bench compare A.json B.json`: each metric of two runs side by side, with B/A.

For latencies a ratio below 1 means B is faster; for throughput, goodput and attainment a
ratio above 1 means B is better. Groups are compared when both runs have them (overall first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (label, path into a group summary, True when higher is better)
METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    *((f"TTFT {q} (ms)", ("ttft_s", q), False) for q in ("p50", "p90", "p99")),
    *((f"TBT {q} (ms)", ("tbt_s", q), False) for q in ("p50", "p90", "p99")),
    ("TPOT p50 (ms)", ("tpot_s", "p50"), False),
    *((f"E2E {q} (ms)", ("e2e_s", q), False) for q in ("p50", "p90")),
    ("requests/s", ("request_throughput",), True),
    ("output tokens/s", ("output_token_throughput",), True),
    ("goodput (req/s)", ("goodput",), True),
    ("SLO attainment", ("attainment",), True),
)


@dataclass(frozen=True)
class Comparison:
    group: str
    metric: str
    a: float | None
    b: float | None
    higher_is_better: bool

    @property
    def ratio(self) -> float | None:
        if self.a is None or self.b is None or self.a == 0:
            return None
        return self.b / self.a

    @property
    def better(self) -> str:
        ratio = self.ratio
        if ratio is None or abs(ratio - 1.0) < 0.02:
            return ""
        return "B" if (ratio > 1.0) == self.higher_is_better else "A"


def _value(group: dict[str, Any], path: tuple[str, ...], label: str) -> float | None:
    value: Any = group
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        return None
    return float(value) * (1000.0 if "(ms)" in label else 1.0)


def compare_summaries(a: dict[str, Any], b: dict[str, Any]) -> list[Comparison]:
    groups = ["overall", *[name for name in a["classes"] if name in b["classes"]]]
    out = []
    for name in groups:
        group_a = a["overall"] if name == "overall" else a["classes"][name]
        group_b = b["overall"] if name == "overall" else b["classes"][name]
        for label, path, higher in METRICS:
            out.append(Comparison(name, label, _value(group_a, path, label), _value(group_b, path, label), higher))
    return out


def format_comparison(rows: list[Comparison], name_a: str, name_b: str) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    lines = [
        f"A = {name_a}",
        f"B = {name_b}",
        "",
        "| group | metric | A | B | B/A | better |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.3f}"
        lines.append(f"| {row.group} | {row.metric} | {cell(row.a)} | {cell(row.b)} | {ratio} | {row.better} |")
    return "\n".join(lines) + "\n"
