"""benchmarks/disagg.py's pure parts: the cluster configs it starts, the metrics it reads, the
targets it judges and the table it prints (no servers here; the script itself is run by hand,
see its docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from servelm.cluster.spec import ClusterConfig, load_cluster_config
from servelm.testing.benchmark_script import load_benchmark_script

ROOT = Path(__file__).resolve().parents[2]

bench = load_benchmark_script(ROOT / "benchmarks" / "disagg.py", "disagg_bench")


def load(system: str, tmp_path: Path) -> ClusterConfig:
    path = tmp_path / f"{system}.yaml"
    path.write_text(bench.cluster_config(system, 30000))
    return load_cluster_config(path)


def test_both_systems_have_two_one_thread_workers_of_the_default_model_behind_the_kv_router(tmp_path: Path):
    pd, agg = load("pd", tmp_path), load("agg", tmp_path)
    assert set(pd.pools()) == {"prefill", "decode"} and set(agg.pools()) == {"replicas"}
    assert [(p.count, p.num_threads) for p in pd.pools().values()] == [(1, 1), (1, 1)]
    assert (agg.replicas.count, agg.replicas.num_threads) == (2, 1)
    for config in (pd, agg):
        assert config.model is None and config.block_size == bench.BLOCK_SIZE
        assert config.router.policy == "kv" and config.router.port == 30000
        assert all(p.kv_events_base_port is not None for p in config.pools().values())  # the kv policy's input
        ports = [port for spec in config.replica_processes() for port in spec_ports(spec)]
        assert len(ports) == len(set(ports)) and all(30000 < p < 30000 + bench.NUM_PORTS for p in ports)
    assert [s.kv_role for s in pd.replica_processes()] == ["prefill", "decode"]
    with pytest.raises(ValueError, match="unknown system 'both'"):
        bench.cluster_config("both", 30000)


def spec_ports(spec) -> list[int]:
    """Every port a replica's command line names: HTTP, KV events (+1: snapshots), KV transfer."""
    argv = list(spec.argv)
    ports = []
    for flag, extra in (("--port", 0), ("--kv-events-port", 1), ("--kv-transfer-port", 0)):
        if flag in argv:
            port = int(argv[argv.index(flag) + 1])
            ports += [port, port + extra] if extra else [port]
    return ports


def test_cluster_urls_are_read_from_its_name_url_lines():
    lines = ["      router  http://127.0.0.1:8000\n", "   prefill-0  http://127.0.0.1:8001\n",
             "started decode-0 (pid 12): log /tmp/x\n", "logs in /tmp/x; Ctrl-C stops everything\n"]  # fmt: skip
    assert bench.cluster_urls(lines) == {"router": "http://127.0.0.1:8000", "prefill-0": "http://127.0.0.1:8001"}


def exposition(decided: dict[tuple[str, str], int], pulled_bytes: float, pull_seconds: list[float]) -> dict:
    """A router's and a worker's metrics, rendered by prometheus_client and parsed as scrape() does."""
    registry = CollectorRegistry()
    decisions = Counter("servelm:router_disagg_decisions", "", ["decision", "reason"], registry=registry)
    for labels, n in decided.items():
        decisions.labels(*labels).inc(n)
    moved = Counter("servelm:kv_transfer_bytes", "", ["model_name", "direction", "medium"], registry=registry)
    moved.labels("m", "load", "remote").inc(pulled_bytes)
    moved.labels("m", "load", "cpu").inc(999)  # another tier: not a pull
    pull = Histogram("servelm:kv_pull_seconds", "", ["model_name"], registry=registry)
    for seconds in pull_seconds:
        pull.labels("m").observe(seconds)
    samples: dict = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            key = (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name")))
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def test_decisions_and_pulls_are_the_phases_deltas():
    before = exposition({("aggregated", "short_prompt"): 3}, 1000, [0.5])
    after = exposition({("aggregated", "short_prompt"): 5, ("disaggregated", "disaggregated"): 4}, 9000, [0.5, 1, 3])
    assert bench.decisions(before, after) == {"aggregated/short_prompt": 2, "disaggregated/disaggregated": 4}
    assert bench.decisions(after, after) == {}
    pulls = bench.pulls(before, after)
    assert (pulls.num_bytes, pulls.num_pulls, pulls.total_s) == (8000, 2, 4.0)
    assert pulls.mean_s == 2.0 and pulls.gbps == pytest.approx(2e-6)
    assert bench.Pulls().mean_s is None and bench.Pulls().gbps is None


def summary(tbt_p99: float, goodput: float, out_tok_s: float, c1_ttft: float) -> tuple[dict, dict]:
    voice = {"tbt_s": {"p50": tbt_p99 / 4, "p99": tbt_p99}, "ttft_s": {"p50": 1.0, "p99": 2.5},
             "attainment": 0.5, "goodput": goodput}  # fmt: skip
    analytics = {"ttft_s": {"p50": 12.0}}
    overall = {"output_token_throughput": out_tok_s, "request_throughput": 0.14, "num_requests": 50, "num_ok": 49}
    mixed = {"classes": {"voice": voice, "analytics": analytics}, "overall": overall}
    return mixed, {"classes": {"voice": {"ttft_s": {"p50": c1_ttft}}}, "overall": {}}


def test_targets_are_improvement_factors_against_the_issues_thresholds():
    tbt, goodput, throughput, c1 = bench.TARGETS
    assert tbt.ratio(0.1, 0.3) == pytest.approx(3.0) and tbt.met(0.1, 0.3)
    assert not tbt.met(0.1, 0.29)
    assert goodput.ratio(0.15, 0.1) == pytest.approx(1.5) and goodput.met(0.15, 0.1)
    assert throughput.met(80, 100) and not throughput.met(79, 100)
    # Within 10 %: pd at most 1.1x agg's TTFT; faster is fine.
    assert c1.met(1.1, 1.0) and c1.met(0.5, 1.0) and not c1.met(1.12, 1.0)
    assert tbt.ratio(None, 0.3) is None and tbt.met(0.1, None) is None and goodput.ratio(0.1, 0.0) is None


def test_table_shows_each_system_the_targets_decisions_pulls_and_bandwidth():
    pd = bench.SystemResult("pd", *summary(0.1, 0.06, 30.0, 0.105), decisions={"disaggregated/disaggregated": 20},
                            c1_decisions={"aggregated/short_prompt": 3}, pulls=bench.Pulls(2.4e9, 20, 240.0))  # fmt: skip
    agg = bench.SystemResult("agg", *summary(0.6, 0.03, 40.0, 0.1))
    bandwidth = {"num_blocks": 64, "block_bytes": 737280, "reps": 5,
                 "results": {"memcpy": {"median_gbps": 8.0}, "tcp": {"median_gbps": 2.0}, "ipc": {"median_gbps": 4.0}}}  # fmt: skip
    table = bench.format_table({"agg": agg, "pd": pd}, bandwidth)
    lines = table.splitlines()
    assert lines[0] == "| metric | pd | agg |"  # pd first, whatever order they ran in
    assert "| voice TBT p99 (ms) | 100 | 600 |" in lines
    assert "| voice goodput (req/s) | 0.060 | 0.030 |" in lines
    assert "| total output throughput (tok/s) | 30.0 | 40.0 |" in lines
    assert "| failed requests | 1 | 1 |" in lines
    assert "| voice TBT p99 (agg / pd) | 100 | 600 | 6.00x | >= 3.00x | yes |" in lines
    assert "| voice goodput (pd / agg) | 0.060 | 0.030 | 2.00x | >= 1.50x | yes |" in lines
    assert "| total output throughput (pd / agg) | 30.0 | 40.0 | 0.75x | >= 0.80x | NO |" in lines
    assert "| concurrency 1 TTFT p50 (agg / pd) | 105 | 100 | 0.95x | >= 0.91x | yes |" in lines
    assert "pd router decisions, phase 1 (+1 warm-up): disaggregated/disaggregated 20" in table
    assert "pd router decisions, concurrency 1 (+1 warm-up): aggregated/short_prompt 3" in table
    assert "20 pulls, 2400.0 MB, mean pull 12000 ms; bytes / pull time 0.010 GB/s" in table
    assert "pull tcp 2.00 GB/s (25% of memcpy), ipc 4.00 GB/s (50% of memcpy); memcpy 8.00 GB/s" in table
    # One system alone: its figures, no targets.
    alone = bench.format_table({"agg": agg}, None)
    assert "| metric | agg |" in alone and "target" not in alone and "pulls" not in alone
