"""From request records to the numbers a report shows, per traffic class and overall.

    latency       TTFT, TBT (every inter-chunk gap of every request, pooled: a stream cut at
                  the run's end counts the gaps its client saw, since the cut ones are the
                  slowest-read, and leaving them out would hide the gaps that grew most), TPOT, E2E:
                  count, mean, p50, p90, p95, p99 (linear interpolation, numpy's default)
    throughput    successful requests, prompt tokens and output tokens per second of run
    SLO           a request meets its class's SLO (see workload.SLO); attainment = met / sent,
                  where failed and cancelled requests count as misses; goodput = met / duration;
                  the class meets its SLO when attainment >= the SLO's percentile
    TTFT split    where the server returned servelm's breakdown, the mean of each component, and
                  "network": what the client measured beyond the server's own TTFT

Everything is computed from the records alone, so a saved JSON report can be re-analysed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from servelm.bench.client import RequestRecord
from servelm.bench.workload import SLO
from servelm.schemas.ttft import NETWORK, TTFT_COMPONENTS, percentile

PERCENTILES = (50, 90, 95, 99)


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    """{"count", "mean", "p50", "p90", "p95", "p99"}; None entries for no values."""
    data = np.asarray(list(values), dtype=float)
    out: dict[str, float | None] = {"count": float(data.size), "mean": float(data.mean()) if data.size else None}
    for q in PERCENTILES:
        out[f"p{q}"] = float(np.percentile(data, q)) if data.size else None
    return out


def meets_slo(record: RequestRecord, slo: SLO | None) -> bool:
    """Did this request meet `slo`? (No SLO: success is enough.)"""
    if not record.ok:
        return False
    if slo is None:
        return True
    if slo.ttft_s is not None and (record.ttft_s is None or record.ttft_s > slo.ttft_s):
        return False
    if slo.e2e_s is not None and (record.e2e_s is None or record.e2e_s > slo.e2e_s):
        return False
    if slo.tbt_s is not None:
        gaps = record.itl_s
        if gaps and (percentile(gaps, slo.percentile) or 0.0) > slo.tbt_s:
            return False
    return True


@dataclass
class GroupSummary:
    """One traffic class, or all of them ("overall")."""

    name: str
    slo: dict[str, Any] | None  # the class's SLO; overall: None (each request is judged by its own class)
    num_requests: int  # sent
    num_ok: int
    num_errors: int
    num_cancelled: int
    num_prompt_tokens: int  # of successful requests
    num_output_tokens: int
    ttft_s: dict[str, float | None]
    tbt_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    request_throughput: float  # successful requests / s
    prompt_token_throughput: float
    output_token_throughput: float
    num_met_slo: int
    attainment: float | None  # met / sent
    goodput: float  # requests meeting their SLO / s
    slo_met: bool | None  # attainment reaches the SLO's percentile (overall: every class does)
    ttft_breakdown_s: dict[str, float] | None  # mean seconds per component, over requests that had one
    num_with_breakdown: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_group(
    name: str, records: list[RequestRecord], slo_of: Callable[[RequestRecord], SLO | None], duration_s: float,
    slo: SLO | None = None,
) -> GroupSummary:  # fmt: skip
    ok = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    met = sum(1 for r in records if meets_slo(r, slo_of(r)))
    attainment = met / len(records) if records else None
    with_split = [r for r in ok if r.ttft_breakdown_s and r.ttft_s is not None]
    return GroupSummary(
        name=name,
        slo=slo.to_dict() if slo is not None else None,
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=sum(1 for r in records if r.status == "error"),
        num_cancelled=sum(1 for r in records if r.status == "cancelled"),
        num_prompt_tokens=sum(r.num_prompt_tokens or 0 for r in ok),
        num_output_tokens=sum(r.num_output_tokens or 0 for r in ok),
        ttft_s=distribution(r.ttft_s for r in ok if r.ttft_s is not None),
        tbt_s=distribution(gap for r in records if r.ok or r.status == "cancelled" for gap in r.itl_s),
        tpot_s=distribution(r.tpot_s for r in ok if r.tpot_s is not None),
        e2e_s=distribution(r.e2e_s for r in ok if r.e2e_s is not None),
        request_throughput=len(ok) / duration,
        prompt_token_throughput=sum(r.num_prompt_tokens or 0 for r in ok) / duration,
        output_token_throughput=sum(r.num_output_tokens or 0 for r in ok) / duration,
        num_met_slo=met,
        attainment=attainment,
        goodput=met / duration,
        slo_met=None if slo is None or attainment is None else attainment * 100.0 >= slo.percentile - 1e-9,
        ttft_breakdown_s=_mean_breakdown(with_split) if with_split else None,
        num_with_breakdown=len(with_split),
    )


def _mean_breakdown(records: list[RequestRecord]) -> dict[str, float]:
    splits = [(r.ttft_s or 0.0, r.ttft_breakdown_s or {}) for r in records]
    out = {c: float(np.mean([split.get(c, 0.0) for _, split in splits])) for c in TTFT_COMPONENTS}
    out[NETWORK] = float(np.mean([ttft - split.get("ttft", 0.0) for ttft, split in splits]))
    return out


@dataclass
class Summary:
    duration_s: float
    overall: GroupSummary
    classes: dict[str, GroupSummary]

    @property
    def all_classes_meet_slo(self) -> bool:
        return all(c.slo_met is not False for c in self.classes.values()) and bool(self.classes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "duration_s": self.duration_s,
            "all_classes_meet_slo": self.all_classes_meet_slo,
            "overall": self.overall.to_dict(),
            "classes": {name: c.to_dict() for name, c in self.classes.items()},
        }


def summarize(records: list[RequestRecord], slos: dict[str, SLO], duration_s: float) -> Summary:
    """Per class (in order of first appearance) and overall."""

    def slo_of(record: RequestRecord) -> SLO | None:
        return slos.get(record.traffic_class)

    names = list(dict.fromkeys(r.traffic_class for r in records))
    classes = {
        name: summarize_group(name, [r for r in records if r.traffic_class == name], slo_of, duration_s, slos.get(name))
        for name in names
    }
    overall = summarize_group("overall", records, slo_of, duration_s)
    overall.slo_met = all(c.slo_met is not False for c in classes.values()) if classes else None
    return Summary(duration_s, overall, classes)
