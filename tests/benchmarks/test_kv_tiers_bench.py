"""benchmarks/kv_tiers.py's pure parts: the sessions it sends, the pool it sizes, the ideal hit rate,
the counters it reads and the targets it checks (no servers here; the script itself is run by hand,
see its docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from servelm.bench.profiles import CODE_CONTEXT_TOKENS, CODE_EDIT_TOKENS, CODE_OUTPUT_TOKENS, CODE_QUESTION_TOKENS
from servelm.bench.tokens import load_token_source
from servelm.testing.benchmark_script import load_benchmark_script

ROOT = Path(__file__).resolve().parents[2]


bench = load_benchmark_script(ROOT / "benchmarks" / "kv_tiers.py", "kv_tiers_bench")


def turn(session, number, prompt, output, cached=0, ttft_s=0.1, ok=True):
    return bench.TurnResult(session, number, ok, ttft_s if ok else None, prompt if ok else 0, cached if ok else None,
                            output if ok else 0, 1.0 if ok else None, None if ok else "boom")  # fmt: skip


def test_sessions_draw_the_code_profile_lengths_with_one_more_turn_and_are_seeded():
    plans = bench.session_lengths(6, 3, None, seed=1)
    assert [p.session_id for p in plans] == [f"session-{i}" for i in range(6)]
    for plan in plans:
        assert len(plan.turns) == 4  # the run's 3, then the restart check's
        first, *later = plan.turns
        assert CODE_CONTEXT_TOKENS[0] + CODE_QUESTION_TOKENS[0] <= first.num_user_tokens
        assert first.num_user_tokens <= CODE_CONTEXT_TOKENS[1] + CODE_QUESTION_TOKENS[1]
        for t in later:
            assert CODE_EDIT_TOKENS[0] + CODE_QUESTION_TOKENS[0] <= t.num_user_tokens
            assert t.num_user_tokens <= CODE_EDIT_TOKENS[1] + CODE_QUESTION_TOKENS[1]
        assert all(CODE_OUTPUT_TOKENS[0] <= t.max_tokens <= CODE_OUTPUT_TOKENS[1] for t in plan.turns)
    assert bench.session_lengths(6, 3, None, seed=1) == plans
    assert bench.session_lengths(6, 3, None, seed=2) != plans
    capped = bench.session_lengths(6, 3, 60, seed=1)
    assert [[t.max_tokens for t in p.turns] for p in capped] == [
        [min(t.max_tokens, 60) for t in p.turns] for p in plans
    ]
    with pytest.raises(ValueError, match="sessions and turns"):
        bench.session_lengths(0, 3, None, seed=1)


def test_session_texts_have_the_planned_token_counts():
    tokens = load_token_source(None)
    lengths = bench.session_lengths(2, 2, None, seed=0)
    plans = bench.build_sessions(tokens, lengths, seed=0)
    for planned, built in zip(lengths, plans):
        assert [tokens.count(t.user_text) for t in built.turns] == [t.num_user_tokens for t in planned.turns]
        assert [t.max_tokens for t in built.turns] == [t.max_tokens for t in planned.turns]
    assert bench.build_sessions(tokens, lengths, seed=0) == plans
    assert len({t.user_text for p in plans for t in p.turns}) == 6


def test_round_robin_sends_one_turn_of_every_session_before_the_next_turn():
    assert bench.round_robin(3, 1, 2) == [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)]
    assert bench.round_robin(2, 5, 5) == [(0, 5), (1, 5)]


def test_estimate_counts_the_growing_conversation():
    per_message = bench.TEMPLATE_TOKENS_PER_MESSAGE
    plans = [bench.SessionPlan("a", [bench.Turn(100, 10), bench.Turn(20, 5), bench.Turn(99, 99)])]
    estimate = bench.estimate_workload(plans, num_turns=2)
    first = per_message + 100 + 2 * per_message  # system message, then the user message and assistant header
    second = first + 10 + 20 + 2 * per_message
    assert estimate.prompt_tokens == first + second
    assert estimate.new_prompt_tokens == (first - per_message) + (second - first - 10)
    assert estimate.output_tokens == 15
    assert estimate.working_set_tokens == estimate.largest_session_tokens == second + 5
    two = bench.estimate_workload(plans * 2, num_turns=2)
    assert two.working_set_tokens == 2 * estimate.working_set_tokens
    assert two.largest_session_tokens == estimate.largest_session_tokens


def test_pool_is_a_quarter_of_the_working_set_unless_concurrent_sessions_need_more():
    estimate = bench.WorkloadEstimate(0, 0, 0, working_set_tokens=10_000, largest_session_tokens=1_000)
    sizing = bench.size_pool(estimate, 4.0, concurrency=1, block_bytes=1000)
    assert sizing.pool_blocks == 157 and not sizing.raised_for_concurrency  # ceil(2500 / 16)
    assert sizing.pool_tokens == 157 * 16 and sizing.pool_bytes == 157_000
    assert sizing.tier_bytes == int(625 * 1000 * bench.TIER_HEADROOM)  # the whole working set, with headroom
    raised = bench.size_pool(estimate, 4.0, concurrency=3, block_bytes=1000)
    assert raised.pool_blocks == 3 * 69 and raised.raised_for_concurrency  # 3 x ceil(1100 / 16)
    with pytest.raises(ValueError, match="ratio"):
        bench.size_pool(estimate, 0.0, 1, 1000)


def test_each_system_gets_its_flags():
    sizing = bench.PoolSizing(pool_blocks=100, block_bytes=2**20, working_set_tokens=6400, raised_for_concurrency=False)
    pool = bench.servelm_args("pool", sizing, None)
    assert pool[pool.index("--num-blocks") + 1] == "100" and "--kv-offloading-size" not in pool
    l2 = bench.servelm_args("l2", sizing, None)
    assert float(l2[l2.index("--kv-offloading-size") + 1]) * 2**30 == sizing.tier_bytes
    l2l3 = bench.servelm_args("l2l3", sizing, Path("/tmp/l3"))
    assert l2l3[l2l3.index("--kv-disk-path") + 1] == "/tmp/l3" and "--kv-offloading-size" in l2l3
    int8 = bench.servelm_args("int8", sizing, None)
    assert int8[int8.index("--kv-cache-dtype") + 1] == "int8" and "--num-blocks" not in int8
    assert round(float(int8[int8.index("--kv-cache-memory") + 1]) * 2**30) == 100 * 2**20  # the pool's bytes
    with pytest.raises(ValueError, match="disk path"):
        bench.servelm_args("l2l3", sizing, None)
    with pytest.raises(ValueError, match="unknown servelm system"):
        bench.servelm_args("vllm", sizing, None)


def test_default_model_block_bytes_follow_its_geometry():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 on CPU: K and V of 16 tokens.
    assert bench.default_model_block_bytes() == 30 * 2 * 3 * 64 * 4 * 16


def test_ideal_is_the_previous_prompt_and_reply_in_whole_blocks():
    assert bench.ideal_cached_tokens(100, 20, 150) == 112  # 119 tokens have KV: 7 whole blocks
    assert bench.ideal_cached_tokens(100, 29, 150) == 128
    assert bench.ideal_cached_tokens(100, 20, 60) == 48  # never the new prompt's last token
    assert bench.ideal_cached_tokens(0, 0, 10) == 0
    turns = [turn(0, 1, 100, 29), turn(0, 2, 150, 10), turn(1, 1, 50, 5, ok=False), turn(1, 2, 80, 5)]
    assert bench.ideal_by_turn(turns) == {(0, 1): 0, (0, 2): 128, (1, 2): 0}


def test_summary_hit_rate_ideal_and_ttft():
    turns = [turn(0, 1, 100, 29, cached=16, ttft_s=1.0), turn(0, 2, 150, 10, cached=112, ttft_s=0.2),
             turn(1, 1, 50, 5, ok=False)]  # fmt: skip
    summary = bench.summarize(turns, bench.ideal_by_turn(turns))
    assert (summary.num_turns, summary.num_ok, summary.prompt_tokens, summary.output_tokens) == (3, 2, 250, 39)
    assert summary.hit_rate == 128 / 250 and summary.ideal_hit_rate == 128 / 250 and summary.of_ideal == 1.0
    assert summary.ttft_ms["p50"] == pytest.approx(600.0) and summary.ttft_later_ms["p50"] == pytest.approx(200.0)
    assert summary.output_tok_s == 39.0  # over the last end, 1 s
    unreported = [turn(0, 1, 100, 29, cached=None)]
    assert bench.summarize(unreported, bench.ideal_by_turn(unreported)).hit_rate is None


def _metrics_page(hits: float, host_hits: float, load_bytes: float, blocks: int) -> str:
    registry = CollectorRegistry()
    labels = ["model_name"]
    for name in ("prefix_cache_queries", "prefix_cache_hits"):
        Counter(f"servelm:{name}", "doc", labels, registry=registry).labels("m").inc(hits if "hits" in name else 1000)
    external = Counter("servelm:external_prefix_cache_hits", "doc", [*labels, "medium"], registry=registry)
    external.labels("m", "host").inc(host_hits)
    external.labels("m", "disk").inc(1)
    moved = Counter("servelm:kv_transfer_bytes", "doc", [*labels, "direction", "medium"], registry=registry)
    moved.labels("m", "load", "host").inc(load_bytes)
    Counter("servelm:request_success", "doc", labels, registry=registry).labels("m").inc(7)
    Gauge("servelm:kv_cache_total_blocks", "doc", labels, registry=registry).labels("m").set(blocks)
    return generate_latest(registry).decode()


def test_tier_counters_keep_medium_and_direction_and_their_deltas():
    before = bench.parse_tier_counters(_metrics_page(10, 0, 0, 64))
    after = bench.parse_tier_counters(_metrics_page(50, 30, 4096, 64))
    assert set(after) == {
        "prefix_cache_queries", "prefix_cache_hits", 'external_prefix_cache_hits{medium="host"}',
        'external_prefix_cache_hits{medium="disk"}', 'kv_transfer_bytes{direction="load",medium="host"}',
    }  # fmt: skip
    deltas = bench.counter_deltas(before, after)
    assert deltas["prefix_cache_hits"] == 40 and deltas['external_prefix_cache_hits{medium="host"}'] == 30
    assert deltas['kv_transfer_bytes{direction="load",medium="host"}'] == 4096 and deltas["prefix_cache_queries"] == 0
    assert bench.pool_blocks_of(_metrics_page(0, 0, 0, 321)) == 321
    assert bench.pool_blocks_of("") is None
    table = bench.counters_table({"pool": deltas})
    assert "n/a" in table.splitlines()[-1]  # disk queries, save bytes: absent here


def _summary(ttft_p50_ms: float, cached: int | None, ideal: int) -> object:
    return bench.Summary(1, 1, {"p50": ttft_p50_ms, "p90": None, "p99": None}, {}, 1000, cached, ideal, 0, 0.0)


def test_targets_met_not_met_and_not_measurable():
    summaries = {"pool": _summary(3000, 0, 900), "l2": _summary(900, 850, 900), "l2l3": _summary(1200, 700, 900),
                 "int8": _summary(2000, 300, 900)}  # fmt: skip
    checks = bench.check_targets(summaries, {"pool": 1600, "int8": 6000}, restart_cached=[300, 0])
    verdicts = {(c.system, c.target.split()[0]): c.met for c in checks}
    assert verdicts == {
        ("l2", "hit"): True, ("l2", "TTFT"): True,  # 94% of ideal, 3.33x
        ("l2l3", "hit"): False, ("l2l3", "TTFT"): False,  # 78%, 2.5x
        ("int8", "int8"): True,  # 3.75x the tokens, TTFT 1.5x better
        ("l2l3", "first"): False,  # one of two restarted turns missed
    }  # fmt: skip
    alone = bench.check_targets({"l2": _summary(900, None, 900)}, {}, restart_cached=None)
    assert [c.met for c in alone] == [None, None]  # no cached tokens reported, no pool to compare with
    assert "n/a" in bench.targets_table(alone)


def test_a_server_that_does_not_start_is_skipped_with_the_cause_from_its_log():
    log = (
        "servelm serve exited with 3 during start-up:\nTraceback (most recent call last):\n"
        '  File "builder.py", line 72, in assemble_engine\n'
        "NotImplementedError: KV tiers (--kv-offloading-size, --kv-disk-path) are not built yet (issue 13)\n\n"
        "ERROR:    Application startup failed. Exiting.\n"
    )
    assert bench.start_error_gist(log) == (
        "servelm serve exited with 3 during start-up: … NotImplementedError: KV tiers (--kv-offloading-size, "
        "--kv-disk-path) are not built yet (issue 13)"
    )
    assert (
        bench.start_error_gist("vLLM not ready after 600 s: see vllm-1.log")
        == "vLLM not ready after 600 s: see vllm-1.log"
    )
    assert bench.start_error_gist("no venv\nlast line") == "no venv … last line"
