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


def test_the_step_time_target_and_the_cost_models_prediction_ratio_are_exported() -> None:
    """What `servelm diagnose` reads to say the step-cost model drifted (diagnose/signals.py)."""
    stats = CoreStats(step_target_s=0.25)
    metrics = ServerMetrics(
        "tiny", 1024, lambda: stats, num_blocks=8, num_in_api=lambda: 0, num_outputs_queued=lambda: 0
    )
    metrics.observe_steps(CoreStats(recent_predictions=[("deep", 0.2, 0.3), ("deep", 0.2, 0.2), ("decode", 0.01, 0.01)]))
    s = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }
    assert s[("servelm:step_time_target_seconds", (("model_name", "tiny"),))] == 0.25
    ratio = "servelm:step_time_prediction_ratio"
    deep = (("kind", "deep"), ("model_name", "tiny"))
    assert s[(ratio + "_count", deep)] == 2 and s[(ratio + "_sum", deep)] == 2.5
    assert s[(ratio + "_bucket", (*deep[:1], ("le", "1.0"), deep[1]))] == 1  # one exact, one 1.5x


def test_diagnose_names_a_drifting_cost_model() -> None:
    from servelm.diagnose.signals import prediction_drift

    assert prediction_drift({"step_prediction_ratio_p10": 0.9, "step_prediction_ratio_p90": 1.2}) is None
    note = prediction_drift({"step_prediction_ratio_p10": 0.9, "step_prediction_ratio_p90": 1.6, "step_target_s": 0.25})
    assert note is not None and "1.60x" in note and "250 ms" in note
    assert prediction_drift({"step_prediction_ratio_p10": 0.6, "step_prediction_ratio_p90": 1.0}) is not None
    assert prediction_drift({}) is None  # an older server exports no prediction: nothing to say
