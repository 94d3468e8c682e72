"""Workload generators against the real tokenizer: exact token counts, prefixes shared token for
token, reproducibility from the seed, arrival processes with the right statistics, trace files."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from collections import Counter
from pathlib import Path

import pytest

from servelm.bench.arrivals import ArrivalConfig, arrival_times
from servelm.bench.profiles import build_workload, load_sharegpt_lengths, parse_weights
from servelm.bench.tokens import TokenSource
from servelm.bench.trace import TraceReplay, load_trace
from servelm.bench.workload import LengthLimits, WorkloadRequest

MIX = {"voice": 0.4, "code": 0.3, "analytics": 0.2, "chat": 0.1}
LIMITS = LengthLimits(max_context=8192)


def _mixed(tokens: TokenSource, seed: int = 0, n: int = 60, limits: LengthLimits = LIMITS) -> list[WorkloadRequest]:
    return build_workload("mixed", n, tokens, limits, seed=seed, weights=MIX)


def test_every_prompt_has_exactly_its_token_count(tokens: TokenSource):
    requests = _mixed(tokens)
    assert {r.traffic_class for r in requests} == set(MIX)
    for r in requests:
        encoded = tokens.encode(r.prompt_text)  # as the server encodes a completions prompt
        assert len(encoded) == r.num_prompt_tokens
        assert encoded[tokens.num_special_tokens :] == r.prompt_ids


def test_lengths_follow_the_profiles(tokens: TokenSource):
    by_class: dict[str, list[WorkloadRequest]] = {}
    for r in _mixed(tokens, n=80):
        by_class.setdefault(r.traffic_class, []).append(r)
    first_turns = [r for r in by_class["voice"] if r.after is None]
    assert first_turns and all(30 <= r.num_prompt_tokens <= 200 for r in first_turns)
    assert all(20 <= r.max_tokens <= 80 for r in by_class["voice"])
    # A code prompt is its repository (1-4k) plus a question (10-60).
    assert all(1000 + 10 <= r.num_prompt_tokens <= 4000 + 60 for r in by_class["code"])
    assert all(50 <= r.max_tokens <= 300 for r in by_class["code"])
    assert all(500 <= r.num_prompt_tokens <= 2000 and 10 <= r.max_tokens <= 100 for r in by_class["analytics"])
    assert all(r.priority > 0 for r in by_class["analytics"]) and all(r.priority == 0 for r in by_class["voice"])


def test_voice_turns_resend_the_conversation(tokens: TokenSource):
    requests = build_workload("voice", 30, tokens, LIMITS, seed=1)
    by_index = {r.index: r for r in requests}
    follow_ups = [r for r in requests if r.after is not None]
    assert len(follow_ups) >= 10
    for r in follow_ups:
        previous = by_index[r.after]
        assert previous.session_id == r.session_id
        # This turn's prompt = the previous prompt + the reply (max_tokens of it) + the new user turn.
        assert r.prompt_ids[: len(previous.prompt_ids)] == previous.prompt_ids
        assert r.shared_prefix_tokens == len(previous.prompt_ids) + previous.max_tokens
        assert 30 <= r.num_prompt_tokens - r.shared_prefix_tokens <= 200
        # ... and the server, tokenizing the text, sees the previous prompt's ids at the front.
        assert tokens.encode(r.prompt_text, add_special_tokens=False)[: len(previous.prompt_ids)] == previous.prompt_ids


def test_code_repositories_are_resent_with_small_edits(tokens: TokenSource):
    requests = build_workload("code", 20, tokens, LIMITS, seed=2)
    last: dict[str, WorkloadRequest] = {}
    for r in requests:
        previous = last.get(r.session_id)
        if previous is not None:
            shared = r.shared_prefix_tokens
            assert shared >= (r.num_prompt_tokens - 60) // 2, "edits sit in the second half of the context"
            assert tokens.encode(r.prompt_text)[:shared] == tokens.encode(previous.prompt_text)[:shared]
            # A small edit: the repository contexts (same length; the question is the last 10-60) differ in <= 30 ids.
            compared = min(len(r.prompt_ids), len(previous.prompt_ids)) - 60
            assert sum(a != b for a, b in zip(r.prompt_ids[:compared], previous.prompt_ids[:compared])) <= 30
        last[r.session_id] = r
    assert len(last) == 3


def test_analytics_documents_share_one_instruction(tokens: TokenSource):
    requests = build_workload("analytics", 6, tokens, LIMITS, seed=3)
    shared = requests[0].shared_prefix_tokens
    assert shared == 64
    heads = {tuple(tokens.encode(r.prompt_text)[:shared]) for r in requests}
    assert len(heads) == 1
    assert len({tuple(r.prompt_ids[shared:]) for r in requests}) == 6


def test_same_seed_same_workload_and_another_seed_differs(tokens: TokenSource):
    def fingerprint(requests: list[WorkloadRequest]) -> list[tuple]:
        return [(r.traffic_class, r.prompt_text, r.max_tokens, r.session_id, r.after) for r in requests]

    assert fingerprint(_mixed(tokens, seed=7, n=30)) == fingerprint(_mixed(tokens, seed=7, n=30))
    assert fingerprint(_mixed(tokens, seed=7, n=30)) != fingerprint(_mixed(tokens, seed=8, n=30))
    config = ArrivalConfig("gamma", rate=3.0, burstiness=0.5)
    assert arrival_times(config, 50, seed=7) == arrival_times(config, 50, seed=7)
    assert arrival_times(config, 50, seed=7) != arrival_times(config, 50, seed=8)


def test_another_salt_keeps_the_structure_and_changes_every_token(tokens: TokenSource):
    """What a sweep's steps get: the same workload shape, nothing in common for a prefix cache."""
    one = _mixed(tokens, seed=3, n=30)
    other = build_workload("mixed", 30, tokens, LIMITS, seed=3, weights=MIX, salt=1)
    shape = [
        (r.traffic_class, r.num_prompt_tokens, r.max_tokens, r.session_id, r.after, r.shared_prefix_tokens) for r in one
    ]
    assert shape == [(r.traffic_class, r.num_prompt_tokens, r.max_tokens, r.session_id, r.after, r.shared_prefix_tokens)
                     for r in other]  # fmt: skip
    starts = {tuple(r.prompt_ids[:8]) for r in one}
    assert not starts & {tuple(r.prompt_ids[:8]) for r in other}


def test_mix_follows_the_weights(tokens: TokenSource):
    limits = LengthLimits(max_context=512, prompt_scale=0.02, max_output_tokens=4)  # small: 400 requests quickly
    counts = Counter(r.traffic_class for r in build_workload("mixed", 400, tokens, limits, weights=parse_weights(
        "voice=0.5,chat=0.25,code=0.25,analytics=0")))  # fmt: skip
    assert set(counts) == {"voice", "chat", "code"}
    assert 160 <= counts["voice"] <= 240 and 70 <= counts["chat"] <= 130 and 70 <= counts["code"] <= 130


def test_everything_fits_a_small_context(tokens: TokenSource):
    limits = LengthLimits(max_context=300, prompt_scale=0.5, max_output_tokens=40)
    for r in _mixed(tokens, n=80, limits=limits):
        assert r.num_prompt_tokens + r.max_tokens <= 300
        assert 1 <= r.max_tokens <= 40
        assert len(tokens.encode(r.prompt_text)) == r.num_prompt_tokens


@pytest.mark.parametrize(
    ("kind", "burstiness", "cv"), [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5)]
)
def test_arrival_gaps_have_the_rate_and_burstiness(kind: str, burstiness: float, cv: float):
    times = arrival_times(ArrivalConfig(kind, rate=5.0, burstiness=burstiness), 4001, seed=11)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.2, rel=0.1)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.15)


def test_daily_arrivals_follow_the_days_curve():
    """1M a day (11.57/s on average): four times the trough's requests in the hour at noon as in the
    hour after midnight (rate x (1 ∓ 0.6)), and the day's count about its mean."""
    from servelm.bench.arrivals import DAY_S, daily_rate

    rate = 1_000_000 / DAY_S / 100  # 10,000 a day: a small sample of the same curve
    times = arrival_times(ArrivalConfig("daily", rate=rate), 10_000, seed=3)
    assert times == sorted(times) and times[-1] == pytest.approx(DAY_S, rel=0.05)
    night = sum(1 for t in times if t < 3600)
    noon = sum(1 for t in times if 11.5 * 3600 <= t < 12.5 * 3600)
    assert night == pytest.approx(3600 * daily_rate(rate, 1800), rel=0.25)
    assert noon == pytest.approx(3600 * daily_rate(rate, DAY_S / 2), rel=0.1)
    assert noon / night == pytest.approx(1.6 / 0.4, rel=0.3)


def _write_trace(path: Path, entries: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    return path


def test_trace_blocks_share_prefixes_and_times_scale(tokens: TokenSource, tmp_path: Path):
    trace = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 36, "output_length": 7, "hash_ids": [1, 2, 9]},
        {"timestamp": 3000, "input_length": 50, "output_length": 3, "hash_ids": [4]},
    ])  # fmt: skip
    replay = TraceReplay(tokens, LengthLimits(1024), seed=0, block_size=16, time_scale=0.5)
    first, second, third = replay.workload(load_trace(trace))
    assert [r.arrival_s for r in (first, second, third)] == pytest.approx([0.0, 0.25, 1.0])
    assert [r.num_prompt_tokens for r in (first, second, third)] == [40, 36, 50]
    assert [r.max_tokens for r in (first, second, third)] == [5, 7, 3]
    assert first.prompt_ids[:32] == second.prompt_ids[:32] and first.prompt_ids[32:36] != second.prompt_ids[32:36]
    assert (first.shared_prefix_tokens, second.shared_prefix_tokens, third.shared_prefix_tokens) == (0, 32, 0)
    assert tokens.encode(third.prompt_text) == third.prompt_ids  # 16 from block 4, then 34 of its own
    again = TraceReplay(tokens, LengthLimits(1024), seed=0, block_size=16, time_scale=0.5).workload(load_trace(trace))
    assert [r.prompt_text for r in again] == [r.prompt_text for r in (first, second, third)]


def test_bad_trace_lines_are_named(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1}\n{"timestamp": 5, "input_length": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(bad)
    backwards = _write_trace(tmp_path / "back.jsonl", [
        {"timestamp": 10, "input_length": 3, "output_length": 1}, {"timestamp": 5, "input_length": 3, "output_length": 1}])  # fmt: skip
    with pytest.raises(ValueError, match="back in time"):
        load_trace(backwards)


def test_clean_words_round_trip_in_any_order(tokens: TokenSource):
    rng = random.Random(5)
    for _ in range(20):
        ids = tokens.sample(rng, rng.randint(1, 300))
        assert tokens.encode(tokens.exact_text(ids), add_special_tokens=False) == ids


def test_chat_lengths_can_come_from_a_sharegpt_file(tokens: TokenSource, tmp_path: Path):
    rng = random.Random(9)
    conversations = [
        {"conversations": [{"from": "human", "value": tokens.decode(tokens.sample(rng, 10 * (i + 1)))},
                           {"from": "gpt", "value": tokens.decode(tokens.sample(rng, 5 * (i + 1)))}]}
        for i in range(4)
    ] + [{"conversations": [{"from": "gpt", "value": "no human turn first"}]}]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    pairs = load_sharegpt_lengths(path, tokens)
    assert sorted(pairs) == [(10, 5), (20, 10), (30, 15), (40, 20)]
    requests = build_workload("chat", 20, tokens, LIMITS, chat_lengths=pairs)
    assert {(r.num_prompt_tokens, r.max_tokens) for r in requests} <= set(pairs)
