"""The scheduler signals diagnose reads: partial prefills (gauge) and prefix-cache evictions by tenant."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from servelm.obs.metrics import ServerMetrics
from servelm.schemas.core_stats import CoreStats


def _samples(stats: CoreStats) -> dict[tuple[str, tuple], float]:
    metrics = ServerMetrics(
        "tiny", 1024, lambda: stats, num_blocks=8, num_in_api=lambda: 0, num_outputs_queued=lambda: 0
    )
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }


def test_partial_prefills_and_evictions_by_tenant_are_exported() -> None:
    s = _samples(CoreStats(num_prefilling=3, prefix_evictions_by_tenant={"alice": 5, "bob": 2}))
    assert s[("servelm:num_requests_prefilling", (("model_name", "tiny"),))] == 3
    evicted = "servelm:prefix_cache_evicted_blocks_total"
    assert s[(evicted, (("model_name", "tiny"), ("tenant", "alice")))] == 5
    assert s[(evicted, (("model_name", "tiny"), ("tenant", "bob")))] == 2


def test_no_tenant_series_before_the_core_reports_one() -> None:
    # The API process's CoreStats before the first batch: no tenant known yet (the core's
    # own stats start with the default tenant at 0, tests/kv).
    s = _samples(CoreStats())
    assert not [key for key in s if key[0].startswith("servelm:prefix_cache_evicted_blocks")]
    assert s[("servelm:num_requests_prefilling", (("model_name", "tiny"),))] == 0
