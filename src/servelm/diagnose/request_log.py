"""A saved request log (`servelm serve --log-requests`, one JSON line per finished request) as a window.

The log is the server's stderr, so other log lines may sit between the JSON ones: a line is a
request when it is a JSON object with a `timeline` (obs/request_log.py writes those). The
window spans the requests' arrivals; each request brings its own TTFT split, exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from servelm.schemas.ttft import TTFT_COMPONENTS


@dataclass(frozen=True)
class LoggedRequest:
    received_unix: float
    slo_class: str  # the `slo_class` field, or the class of its integer `priority` (metrics' label)
    tenant: str
    prompt_tokens: int
    completion_tokens: int
    num_preemptions: int
    ttft_s: float | None  # None: the request produced no first token
    components_s: dict[str, float]  # ingress, queue, prefill, preemption, output


@dataclass(frozen=True)
class RequestLog:
    label: str
    source: str  # the file
    requests: tuple[LoggedRequest, ...]

    @property
    def start_unix(self) -> float:
        return min(r.received_unix for r in self.requests)

    @property
    def end_unix(self) -> float:
        return max(r.received_unix for r in self.requests)

    @property
    def duration_s(self) -> float:
        """Arrival span; with n requests it holds n − 1 inter-arrival gaps (see request_rate)."""
        return max(self.end_unix - self.start_unix, 1e-9)

    @property
    def request_rate(self) -> float | None:
        return (len(self.requests) - 1) / self.duration_s if len(self.requests) > 1 else None


def read_request_log(path: Path) -> RequestLog:
    """Parse the file; raises ValueError when it holds no request lines."""
    path = Path(path)
    requests = [_request(record) for record in _json_objects(path) if isinstance(record.get("timeline"), dict)]
    if not requests:
        raise ValueError(f"{path} holds no request lines (expected the output of `servelm serve --log-requests`)")
    requests.sort(key=lambda r: r.received_unix)
    return RequestLog(label=path.stem, source=str(path), requests=tuple(requests))


def _json_objects(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a log line that happens to start with a brace
            if isinstance(record, dict):
                out.append(record)
    return out


def _request(record: dict) -> LoggedRequest:
    timeline = record["timeline"]
    split_ms = timeline.get("ttft_breakdown_ms")
    priority = int(record.get("priority", 0))
    return LoggedRequest(
        received_unix=float(timeline["received_unix"]),
        slo_class=str(record.get("slo_class") or ("interactive" if priority <= 0 else "batch")),
        tenant=str(record.get("tenant") or "default"),
        prompt_tokens=int(record.get("prompt_tokens", 0)),
        completion_tokens=int(record.get("completion_tokens", 0)),
        num_preemptions=sum(int(c.get("num_preemptions", 0)) for c in timeline.get("choices", [])),
        ttft_s=split_ms["ttft"] / 1000.0 if split_ms else None,
        # A log written before a component existed (kv_load) lacks it: 0 s there.
        components_s={c: split_ms.get(c, 0.0) / 1000.0 for c in TTFT_COMPONENTS} if split_ms else {},
    )
