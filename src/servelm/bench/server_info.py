"""What the benchmark learns about the server before and after a run, over plain HTTP.

- GET /v1/models: the model id (a tokenizer path, with luck), and `max_model_len` when the
  server says it (servelm and vLLM do); it is the one endpoint every target must have.
- GET /metrics, when there is one: Prometheus counters (`servelm:`, `vllm:`, `sglang:`),
  read before and after a run. Their difference is the server's own count of the run's
  requests and tokens, a cross-check of ours, and what the server did meanwhile (prefix-cache
  hits, preemptions). A server whose metrics are named `servelm:` is servelm: it gets
  servelm's request fields (priority, the TTFT-breakdown timeline).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

COUNTER_PREFIXES = ("servelm:", "vllm:", "sglang:")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class ServerInfo:
    base_url: str
    model_id: str | None
    model_root: str | None  # vLLM's `root`: often the path the model was loaded from
    max_model_len: int | None
    is_servelm: bool
    has_metrics: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe_server(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> ServerInfo:
    """Ask /v1/models (required) and /metrics (optional) what the server is."""
    with httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout_s) as http:
        try:
            response = http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise RuntimeError(f"cannot reach {base_url}/v1/models: {exc}") from exc
        if response.status_code != 200:
            raise RuntimeError(f"GET {base_url}/v1/models answered {response.status_code}: {response.text[:300]}")
        cards = response.json().get("data") or [{}]
        card = cards[0]
        metrics = _get_metrics(http)
    length = card.get("max_model_len")
    return ServerInfo(
        base_url=base_url,
        model_id=card.get("id"),
        model_root=card.get("root"),
        max_model_len=int(length) if length else None,
        is_servelm=card.get("owned_by") == "servelm" or (metrics is not None and "servelm:" in metrics),
        has_metrics=metrics is not None,
    )


def _get_metrics(http: httpx.Client) -> str | None:
    try:
        response = http.get("/metrics")
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def parse_counters(text: str) -> dict[str, float]:
    """Every `*_total` sample of a known prefix, summed over its labels: {name: value}."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, value = match.group(1), match.group(3)
        if name.endswith("_total") and name.startswith(COUNTER_PREFIXES):
            try:
                totals[name] = totals.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return totals


def scrape_counters(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> dict[str, float] | None:
    """The server's counters now, or None when it has no /metrics."""
    with httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout_s) as http:
        text = _get_metrics(http)
    return parse_counters(text) if text is not None else None


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {name: after[name] - before.get(name, 0.0) for name in sorted(after)}
