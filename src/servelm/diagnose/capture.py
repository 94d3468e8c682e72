"""A window of a live server's metrics, saved to a directory every diagnose reader understands.

    DIR/window.json         {"label", "source" (URL), "start_unix", "end_unix",
                             "sample_interval_s", "num_samples", "num_failed_samples"}
    DIR/metrics_start.prom  GET /metrics at the window's start (Prometheus text, as served)
    DIR/metrics_end.prom    GET /metrics at its end
    DIR/gauges.jsonl        one line per sample, every ~sample_interval_s, the start and end scrapes
                            included: {"t": unix_s, "<gauge family name>": value, ...}, each gauge
                            summed over its label sets (one series on a server, one per replica on a router)
    DIR/bench.json          optional: the `servelm bench run` report (schema servelm-bench/1) of the
                            load that ran in the window (client-side TTFT, the network component)

Counters and histograms need only the two ends (their difference is the window); gauges are
instantaneous, so they are sampled in between, and a reader takes their mean and maximum.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

from servelm.diagnose.prom import gauge_totals, parse_text

WINDOW_FILE = "window.json"
METRICS_START_FILE = "metrics_start.prom"
METRICS_END_FILE = "metrics_end.prom"
GAUGES_FILE = "gauges.jsonl"
BENCH_FILE = "bench.json"
BENCH_SCHEMA = "servelm-bench/1"

logger = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """/metrics could not be read at a window's start or end."""


class WindowRecorder:
    """Records one window of `base_url`'s /metrics into `out_dir` (layout in the module doc).

    Used once, by whoever runs the load (the CLI, a scenario, a test):

        async with WindowRecorder(url, Path("win"), "baseline") as recorder:
            ...  # the traffic of the window
            recorder.write_bench_report(report)  # optional, inside or after the block

    Enter: creates `out_dir`, scrapes /metrics (CaptureError if unreachable or not 200), writes
    metrics_start.prom and starts sampling gauges in a task on the running event loop. A sample
    that fails mid-window is skipped (counted in window.json), so a loaded server that answers a
    scrape late costs a sample, not the window. Exit (also when the block raised): stops sampling,
    scrapes the end, writes metrics_end.prom and window.json. Not re-entrant; files are overwritten.
    """

    def __init__(
        self,
        base_url: str,
        out_dir: Path,
        label: str,
        api_key: str | None = None,
        sample_interval_s: float = 0.5,
    ) -> None:
        if sample_interval_s <= 0:
            raise ValueError(f"sample_interval_s must be > 0, got {sample_interval_s}")
        self.base_url = base_url.rstrip("/")
        self.out_dir = Path(out_dir)
        self.label = label
        self.sample_interval_s = sample_interval_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=30.0)
        self._gauges: IO[str] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._start_unix = 0.0
        self._num_samples = 0
        self._num_failed = 0

    async def __aenter__(self) -> WindowRecorder:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            text = await self._scrape()
        except BaseException:
            await self._http.aclose()
            raise
        self._start_unix = time.time()
        (self.out_dir / METRICS_START_FILE).write_text(text)
        self._gauges = (self.out_dir / GAUGES_FILE).open("w")
        self._record_gauges(self._start_unix, text)
        self._sampler = asyncio.create_task(self._sample_until_cancelled())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._sampler is not None and self._gauges is not None, "exit without enter"
        self._sampler.cancel()
        try:
            await self._sampler
        except asyncio.CancelledError:
            pass
        try:
            text = await self._scrape()
            end_unix = time.time()
            (self.out_dir / METRICS_END_FILE).write_text(text)
            self._record_gauges(end_unix, text)
        finally:
            self._gauges.close()
            await self._http.aclose()
        window = {
            "label": self.label,
            "source": self.base_url,
            "start_unix": self._start_unix,
            "end_unix": end_unix,
            "sample_interval_s": self.sample_interval_s,
            "num_samples": self._num_samples,
            "num_failed_samples": self._num_failed,
        }
        (self.out_dir / WINDOW_FILE).write_text(json.dumps(window, indent=1) + "\n")

    def write_bench_report(self, report: dict[str, Any]) -> None:
        """Save the bench report of this window's load as bench.json (safe to call again: it overwrites)."""
        if report.get("schema") != BENCH_SCHEMA:
            raise ValueError(f"not a servelm bench report: schema {report.get('schema')!r}, expected {BENCH_SCHEMA!r}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / BENCH_FILE).write_text(json.dumps(report, indent=1))

    async def _scrape(self) -> str:
        try:
            response = await self._http.get("/metrics")
        except httpx.HTTPError as exc:
            raise CaptureError(f"cannot read {self.base_url}/metrics: {exc!r}") from exc
        if response.status_code != 200:
            hint = " (the server protects /metrics: pass its API key)" if response.status_code == 401 else ""
            raise CaptureError(f"GET {self.base_url}/metrics answered {response.status_code}{hint}")
        return response.text

    def _record_gauges(self, unix_s: float, text: str) -> None:
        assert self._gauges is not None
        line = {"t": unix_s, **gauge_totals(parse_text(text))}
        self._gauges.write(json.dumps(line) + "\n")
        self._gauges.flush()  # a window cut short by a crash keeps the samples it took
        self._num_samples += 1

    async def _sample_until_cancelled(self) -> None:
        next_at = time.monotonic() + self.sample_interval_s
        while True:
            await asyncio.sleep(max(next_at - time.monotonic(), 0.0))
            next_at += self.sample_interval_s
            try:
                text = await self._scrape()
                self._record_gauges(time.time(), text)
            except (CaptureError, ValueError) as exc:  # unreachable for a moment, or a garbled scrape
                self._num_failed += 1
                logger.warning("window %s: gauge sample skipped: %s", self.label, exc)
            next_at = max(next_at, time.monotonic())  # a slow scrape delays the schedule, never bunches it


async def record_window(
    base_url: str, out_dir: Path, label: str, seconds: float, api_key: str | None = None,
    sample_interval_s: float = 0.5,
) -> Path:  # fmt: skip
    """Record `seconds` of whatever traffic the server gets meanwhile (`servelm diagnose capture`); returns out_dir."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    async with WindowRecorder(base_url, out_dir, label, api_key, sample_interval_s):
        await asyncio.sleep(seconds)
    return Path(out_dir)
