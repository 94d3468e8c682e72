"""deploy/grafana/servelm.json is a Grafana dashboard whose every query names metrics and labels
that a real `servelm serve` exports.

A real server on a tiny model serves a few requests (both priority classes, streamed and not),
then its /metrics is the reference for every panel's PromQL (promql_refs.py: the metrics, labels
and label values a query names must be exported).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from promql_refs import Exposition, QueryRefs, parse_exposition, parse_refs, problems

from servelm.server.launcher import launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "servelm.json"
MODEL_FILTER = ("model_name", "=~", "$model_name")
# What the dashboard is for (issue 11): each of these must be on some panel.
REQUIRED_METRICS = {
    "servelm:time_to_first_token_seconds_bucket", "servelm:inter_token_latency_seconds_bucket",
    "servelm:ttft_component_seconds_sum", "servelm:request_queue_time_seconds_bucket",
    "servelm:num_requests_waiting", "servelm:num_requests_running", "servelm:kv_cache_usage_perc",
    "servelm:prefix_cache_hits_total", "servelm:prefix_cache_queries_total", "servelm:engine_step_seconds_bucket",
    "servelm:iteration_tokens_sum", "servelm:num_preemptions_total", "servelm:request_success_total",
    "servelm:api_event_loop_lag_seconds_bucket", "servelm:stream_output_backlog_bucket",
    "servelm:num_outputs_queued_in_api",
}  # fmt: skip


def _label_values_refs(query: str) -> QueryRefs:
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
    assert match, f"a query variable should be label_values(metric, label): {query!r}"
    refs = parse_refs(match.group(1))
    return QueryRefs(refs.selectors, [([match.group(2)], [s.metric for s in refs.selectors])])


# -- the dashboard and the exposition --------------------------------------------------------------


def _panels(panels: list[dict]) -> Iterator[dict]:
    """Every panel, rows' nested (collapsed) panels included."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _load() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict) -> list[tuple[str, QueryRefs]]:
    """(where, refs) of every panel target and every query variable."""
    out = [
        (f"panel {panel['title']!r} target {target['refId']}", parse_refs(target["expr"]))
        for panel in _panels(dashboard["panels"])
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            out.append((f"variable {variable['name']}", _label_values_refs(variable["definition"])))
    return out


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> Exposition:
    """/metrics of a real server after streamed and whole requests of both priority classes."""
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-dashboard") / "model", seed=3)
    # With speculation on, so the spec_decode_* counters (by position too) have samples; with KV
    # tiers, so the tier metrics (by medium) do.
    speculative = '{"method": "ngram", "num_speculative_tokens": 2, "adaptive": false}'
    tiers = ["--kv-offloading-size", "0.01", "--kv-disk-path", str(tmp_path_factory.mktemp("kv-disk"))]
    server = launch_server(
        model,
        ["--num-blocks", "256", "--max-num-seqs", "8", "--num-threads", "1", "--speculative-config", speculative, *tiers],
    )
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            for priority, stream in ((0, True), (5, False), (0, False), (5, True)):
                body = {
                    "prompt": "The same prompt, twice or more",
                    "max_tokens": 6,
                    "priority": priority,
                    "stream": stream,
                }
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
            text = client.get("/metrics").text
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
    return parse_exposition(text)


# -- tests -----------------------------------------------------------------------------------------


def test_dashboard_is_a_grafana_dashboard_over_a_chosen_datasource_and_model():
    dashboard = _load()
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["definition"].startswith("label_values(")
    panels = list(_panels(dashboard["panels"]))
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), f"{panel['title']}: refIds must be unique"
    for where, refs in _queries(dashboard):
        for selector in refs.selectors:
            if where.startswith("panel"):
                assert MODEL_FILTER in selector.matchers, f"{where}: {selector.metric} ignores the model variable"
    referenced = {s.metric for _, refs in _queries(dashboard) for s in refs.selectors}
    assert REQUIRED_METRICS <= referenced, f"no panel shows {sorted(REQUIRED_METRICS - referenced)}"


def test_every_query_names_metrics_and_labels_the_server_exports(exposition):
    found = {where: problems(refs, exposition) for where, refs in _queries(_load())}
    assert not {where: p for where, p in found.items() if p}


@pytest.mark.parametrize(
    "expr, expected",
    [
        ("sum(rate(servelm:no_such_metric_total[5m]))", "servelm:no_such_metric_total is not exported"),
        ("rate(servelm:request_success[5m])", "request_success is not exported"),  # a counter's samples end in _total
        ("histogram_quantile(0.9, rate(servelm:time_to_first_token_seconds[5m]))", "is not exported"),  # no _bucket
        ("sum by (tenant) (rate(servelm:num_requests_running[5m]))", "grouped by ['tenant']"),
        ("sum(rate(servelm:prompt_tokens_total[5m])) by (le)", "grouped by ['le']"),
        ('servelm:ttft_component_seconds_count{component="decode"}', "never has component='decode'"),
        ('servelm:num_requests_running{priority="batch"}', "has no label priority"),
    ],
)
def test_the_check_finds_what_the_server_does_not_export(exposition, expr, expected):
    assert any(expected in problem for problem in problems(parse_refs(expr), exposition))


def test_the_check_passes_what_the_server_exports(exposition):
    expr = ('histogram_quantile(0.5, sum by (le, slo_class) (rate(servelm:ttft_component_seconds_bucket'
            '{component="queue", slo_class="batch"}[5m])))')  # fmt: skip
    assert problems(parse_refs(expr), exposition) == []
    with pytest.raises(ValueError, match="unknown PromQL function"):
        parse_refs("rat(servelm:request_success_total[5m])")
