"""Router metrics (Prometheus, prefix `servelm:router_`), on the router's own registry."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from servelm.router.replicas import ReplicaSet

PREFIX = "servelm:router_"
# Matched prefix length in tokens: from nothing to a long shared context.
MATCH_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

HANDOFF_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _ReplicaGauges:
    """In-flight, outstanding tokens and health per replica, read at scrape time."""

    def __init__(self, replicas: Callable[[], ReplicaSet]) -> None:
        self._replicas = replicas

    def collect(self) -> list[Metric]:
        in_flight = GaugeMetricFamily(PREFIX + "in_flight", "Requests in flight per replica.", labels=["replica"])
        tokens = GaugeMetricFamily(
            PREFIX + "outstanding_tokens", "Prompt + max output tokens in flight per replica.", labels=["replica"]
        )
        healthy = GaugeMetricFamily(PREFIX + "replica_healthy", "1 if the replica is in rotation.", labels=["replica"])
        prefills = GaugeMetricFamily(
            PREFIX + "prefill_in_flight",
            "Disaggregated prefill calls in flight per prefill worker.",
            labels=["replica"],
        )
        for replica in self._replicas().all():
            in_flight.add_metric([replica.url], replica.in_flight)
            tokens.add_metric([replica.url], replica.outstanding_tokens)
            healthy.add_metric([replica.url], 1.0 if replica.healthy else 0.0)
            if replica.is_producer:
                prefills.add_metric([replica.url], replica.prefills_in_flight)
        return [in_flight, tokens, healthy, prefills]


class RouterMetrics:
    def __init__(self, replicas: Callable[[], ReplicaSet]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests",
            "Requests sent to each replica (retries included).",
            ["replica"],
            registry=self.registry,
        )
        self.decisions = Counter(
            PREFIX + "routing_decisions", "Routing decisions by reason.", ["reason"], registry=self.registry
        )
        self.retries = Counter(
            PREFIX + "retries", "Requests retried on another replica before their first byte.", registry=self.registry
        )
        self.failures = Counter(
            PREFIX + "request_failures", "Attempts that failed, by replica.", ["replica"], registry=self.registry
        )
        self.prefix_match_tokens = Histogram(
            PREFIX + "prefix_match_tokens", "Prompt tokens the chosen replica was expected to have cached.",
            buckets=MATCH_TOKEN_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.matched_blocks = Counter(
            PREFIX + "matched_blocks", "Prompt blocks the chosen replica was expected to serve without computing, by "
            "medium: device (its pool), host / disk (loaded from its KV tiers).", ["medium"], registry=self.registry,
        )  # fmt: skip
        self.disagg_decisions = Counter(
            PREFIX + "disagg_decisions", "Prefill/decode split decisions per attempt: disaggregated, or aggregated "
            "and why (router/disagg.py).", ["decision", "reason"], registry=self.registry,
        )  # fmt: skip
        self.prefill_calls = Counter(
            PREFIX + "prefill_calls", "Disaggregated prefill calls by outcome: ok, error (the decode worker computed "
            "the prompt itself), cancelled (the client or the decode attempt went first).", ["outcome"],
            registry=self.registry,
        )  # fmt: skip
        self.disagg_handoff = Histogram(
            PREFIX + "disagg_handoff_seconds", "Disaggregated requests: the prefill worker's answer (its prefill "
            "done) → the decode worker's first byte (the KV landed and the first token sampled there).",
            buckets=HANDOFF_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.migrations = Counter(
            PREFIX + "migrations", "Streams continued on another replica after theirs failed mid-stream (migration.py), "
            "by cause: connection (reset), closed (ended before [DONE]), stalled (no byte for the stall timeout), "
            "replica_error (an error event, a choice finished by error/abort).", ["cause"], registry=self.registry,
        )  # fmt: skip
        self.migration_failures = Counter(
            PREFIX + "migration_failures", "Streams that ended in an error event because they could not be continued: "
            "budget (max migrations used), no_replica (none left or none answered), unknown_prompt.", ["reason"],
            registry=self.registry,
        )  # fmt: skip
        self.migration_seconds = Histogram(
            PREFIX + "migration_seconds", "A migrated stream's gap: its replica failed → the next replica's first "
            "event written to the client (the continuation's prefill included).", buckets=HANDOFF_BUCKETS,
            registry=self.registry,
        )  # fmt: skip
        self.streams_cut = Counter(
            PREFIX + "streams_cut", "Responses cut because their client took no data for --stream-stall-timeout-s "
            "(openai_api/stall_guard.py); the upstream request is closed with them.", registry=self.registry,
        )  # fmt: skip
        self.registry.register(_ReplicaGauges(replicas))

    def render(self) -> bytes:
        return generate_latest(self.registry)
