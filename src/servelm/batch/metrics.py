"""The batch runner's Prometheus series, read at scrape time: how many lines run beside interactive
traffic, how many the pacer allows, and how lines have ended since the process started."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servelm.batch.service import BatchService

PREFIX = "servelm:"


class BatchCollector(Collector):
    def __init__(self, model_name: str, service: BatchService) -> None:
        self.model_name = model_name
        self.service = service

    def collect(self) -> Iterable[Metric]:
        state = self.service.pacing_state()
        in_flight = GaugeMetricFamily(PREFIX + "batch_lines_in_flight", "Batch lines running now (all batches).",
                                      labels=["model_name"])  # fmt: skip
        in_flight.add_metric([self.model_name], state.in_flight)
        allowed = GaugeMetricFamily(PREFIX + "batch_lines_allowed", "Batch lines the pacer allows in flight now: "
                                    "fewer while interactive requests wait (servelm.batch.pacing).",
                                    labels=["model_name"])  # fmt: skip
        allowed.add_metric([self.model_name], state.allowed)
        finished = CounterMetricFamily(PREFIX + "batch_lines_finished", "Batch lines ended since start-up, by the "
                                       "file their result went to (output: 2xx; error: any other).",
                                       labels=["model_name", "file"])  # fmt: skip
        finished.add_metric([self.model_name, "output"], state.finished_output)
        finished.add_metric([self.model_name, "error"], state.finished_error)
        yield from (in_flight, allowed, finished)
