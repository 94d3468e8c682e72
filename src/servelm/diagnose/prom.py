"""Prometheus text, parsed once into plain samples: what capture and window reading share.

A scrape becomes {family name: Family}; a family holds its type and its samples, each a
(sample name, labels, value). Counter families are keyed without `_total` (the parser's
convention), so `servelm:prefix_cache_hits` holds the sample `servelm:prefix_cache_hits_total`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str  # the sample's own name: `…_bucket`, `…_sum`, `…_count`, `…_total`, or the family's
    labels: tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable, order-independent
    value: float


@dataclass(frozen=True)
class Family:
    name: str
    type: str  # counter | gauge | histogram | summary | untyped | ...
    samples: tuple[Sample, ...]


def parse_text(text: str) -> dict[str, Family]:
    """Every family of one exposition; raises ValueError naming the bad line on malformed text."""
    families: dict[str, Family] = {}
    for metric in text_string_to_metric_families(text):
        samples = tuple(Sample(s.name, tuple(sorted(s.labels.items())), float(s.value)) for s in metric.samples)
        families[metric.name] = Family(metric.name, metric.type, samples)
    return families


def gauge_totals(families: dict[str, Family]) -> dict[str, float]:
    """Each gauge family's value summed over its label sets (one series on a server; per replica on a router).

    prometheus_client's `*_created` gauges (a counter's creation time) are not gauges of anything: left out.
    """
    return {
        family.name: sum(s.value for s in family.samples)
        for family in families.values()
        if family.type == "gauge" and family.samples and not family.name.endswith("_created")
    }
