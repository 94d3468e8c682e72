"""Routing decisions of every policy on synthetic requests and load states (no I/O)."""

from __future__ import annotations

from collections import Counter

import pytest

from servelm.cli import main
from servelm.kv.block_hash import hash_block_tokens
from servelm.router.kv_index import KVMatch
from servelm.router.policies import (
    POLICIES,
    PolicyContext,
    PolicySettings,
    RequestView,
    SessionAffinity,
    make_policy,
)
from servelm.router.replicas import Replica, ReplicaSpec
from servelm.schemas.kv_events import DEVICE, DISK, HOST, KVSnapshot

BLOCK = 16


def replicas(n: int = 3) -> list[Replica]:
    return [Replica(ReplicaSpec(f"http://r{i}"), healthy=True) for i in range(n)]


def view(tenant: int, question: int = 0, num_tenant_tokens: int = 256, session: str | None = None) -> RequestView:
    tokens = [1000 + tenant] * num_tenant_tokens + [5000 + question] * 20
    hashes = hash_block_tokens(tokens, BLOCK)
    return RequestView(hashes, len(tokens), 16, session, hashes[0])


def test_registry_lists_valid_names_on_error() -> None:
    with pytest.raises(ValueError, match="round_robin, least_load, prefix, kv"):
        make_policy("random", PolicyContext())
    assert set(POLICIES) == {"round_robin", "least_load", "prefix", "kv"}


def test_round_robin_cycles_over_candidates() -> None:
    policy, fleet = make_policy("round_robin", PolicyContext()), replicas(3)
    chosen = [policy.choose(view(0), fleet).replica.url for _ in range(6)]
    assert chosen == ["http://r0", "http://r1", "http://r2"] * 2


@pytest.mark.parametrize("metric", ["requests", "tokens"])
def test_least_load_picks_the_idlest(metric: str) -> None:
    policy, fleet = make_policy("least_load", PolicyContext(PolicySettings(load_metric=metric))), replicas(3)
    fleet[0].in_flight, fleet[1].in_flight, fleet[2].in_flight = 3, 1, 2
    fleet[0].outstanding_tokens, fleet[1].outstanding_tokens, fleet[2].outstanding_tokens = 100, 900, 50
    decision = policy.choose(view(0), fleet)
    assert decision.replica.url == ("http://r1" if metric == "requests" else "http://r2")
    assert decision.reason == "least_load"


def test_least_load_ties_spread_by_request() -> None:
    policy, fleet = make_policy("least_load", PolicyContext()), replicas(3)
    counts = Counter(policy.choose(view(t), fleet).replica.url for t in range(60))
    assert len(counts) == 3 and min(counts.values()) >= 8


@pytest.mark.parametrize("name", ["prefix", "kv"])
def test_cache_misses_spread_over_the_fleet(name: str) -> None:
    """Known failure of other routers: every miss to one replica. Distinct prefixes must spread."""
    policy, fleet = make_policy(name, PolicyContext()), replicas(3)
    counts = Counter()
    for tenant in range(60):
        decision = policy.choose(view(tenant), fleet)
        assert decision.reason == "cache_miss" and decision.matched_blocks == 0
        counts[decision.replica.url] += 1
    assert len(counts) == 3 and min(counts.values()) >= 8


def test_prefix_policy_keeps_a_prefix_where_it_was_sent() -> None:
    ctx = PolicyContext()
    policy, fleet = make_policy("prefix", ctx), replicas(3)
    first = policy.choose(view(7, 0), fleet)
    assert first.reason == "cache_miss"
    for question in range(1, 10):
        decision = policy.choose(view(7, question), fleet)
        assert decision.replica is first.replica
        assert decision.reason == "prefix_hit" and decision.matched_blocks == 256 // BLOCK


def test_prefix_policy_hot_replica_sheds_load_but_affinity_stays_on_elsewhere() -> None:
    """Known failure of other routers: one hot replica switches cache affinity off fleet-wide."""
    settings = PolicySettings(load_weight=1.0, capacity=8)
    policy, fleet = make_policy("prefix", PolicyContext(settings)), replicas(3)
    homes = {t: policy.choose(view(t), fleet).replica for t in range(12)}
    hot = homes[0]
    hot.in_flight = 20  # 2.5 capacities: outweighs a full hit (1.0)
    for tenant, home in homes.items():
        decision = policy.choose(view(tenant, 1), fleet)
        if home is hot:
            assert decision.replica is not hot
        else:
            assert decision.replica is home and decision.reason == "prefix_hit"


def test_prefix_policy_load_within_reason_keeps_affinity() -> None:
    settings = PolicySettings(load_weight=1.0, capacity=8)
    policy, fleet = make_policy("prefix", PolicyContext(settings)), replicas(2)
    home = policy.choose(view(1), fleet).replica
    home.in_flight = 4  # penalty 0.5 < ~0.93 hit
    assert policy.choose(view(1, 2), fleet).replica is home


def _kv_context_with(holdings: dict[str, list[bytes]]) -> PolicyContext:
    ctx = PolicyContext()
    for url, hashes in holdings.items():
        ctx.kv_index.apply_snapshot(url, KVSnapshot(epoch="e", seq=0, block_size=BLOCK, block_hashes=hashes))
    return ctx


def test_kv_policy_prefers_the_longest_held_prefix() -> None:
    request = view(3)
    ctx = _kv_context_with({"http://r0": list(request.block_hashes[:4]), "http://r1": list(request.block_hashes[:12])})
    decision = make_policy("kv", ctx).choose(request, replicas(3))
    assert (decision.replica.url, decision.reason, decision.matched_blocks) == ("http://r1", "kv_hit", 12)


def test_kv_policy_counts_only_a_leading_run() -> None:
    request = view(3)
    # r1 holds later blocks but not block 0: useless to the engine (hash chain), so it scores 0.
    ctx = _kv_context_with({"http://r0": list(request.block_hashes[:2]), "http://r1": list(request.block_hashes[1:])})
    decision = make_policy("kv", ctx).choose(request, replicas(2))
    assert decision.replica.url == "http://r0" and decision.matched_blocks == 2


def test_kv_policy_weighs_hit_against_load() -> None:
    request = view(3)
    ctx = _kv_context_with({"http://r0": list(request.block_hashes)})
    policy, fleet = make_policy("kv", ctx), replicas(2)
    fleet[0].in_flight = 4
    assert policy.choose(request, fleet).replica.url == "http://r0"
    fleet[0].in_flight = 16  # two capacities of load: worse than recomputing
    assert policy.choose(request, fleet).replica.url == "http://r1"


def test_session_affinity_sticks_until_overloaded_or_gone() -> None:
    settings = PolicySettings()
    policy = SessionAffinity(make_policy("round_robin", PolicyContext(settings)), settings, overload=16)
    fleet = replicas(3)
    home = policy.choose(view(0, session="s1"), fleet).replica
    for question in range(5):
        decision = policy.choose(view(question, question, session="s1"), fleet)
        assert decision.replica is home and decision.reason == "session"
    home.in_flight = 16
    moved = policy.choose(view(0, session="s1"), fleet)
    assert moved.replica is not home and moved.reason == "round_robin"
    others = [r for r in fleet if r is not moved.replica]
    assert policy.choose(view(0, session="s1"), others).replica is not moved.replica  # gone: rerouted
    no_session = Counter(policy.choose(view(0), fleet).replica.url for _ in range(3))
    assert len(no_session) == 3  # requests without a session are untouched


def test_session_table_is_bounded() -> None:
    settings = PolicySettings()
    policy = SessionAffinity(make_policy("least_load", PolicyContext(settings)), settings, overload=16, max_sessions=10)
    for i in range(100):
        policy.choose(view(0, session=f"s{i}"), replicas(2))
    assert policy.num_sessions() == 10


def _tiered_context(
    holdings: dict[str, dict[str, list[bytes]]], settings: PolicySettings | None = None
) -> PolicyContext:
    ctx = PolicyContext(settings or PolicySettings())
    for url, media in holdings.items():
        tiers = {medium: hashes for medium, hashes in media.items() if medium != DEVICE}
        snapshot = KVSnapshot(epoch="e", seq=0, block_size=BLOCK, block_hashes=media.get(DEVICE, []),
                              tier_block_hashes=tiers)  # fmt: skip
        ctx.kv_index.apply_snapshot(url, snapshot)
    return ctx


def test_kv_policy_ranks_pool_over_host_over_disk_over_miss() -> None:
    request = view(3)
    whole = list(request.block_hashes)
    ctx = _tiered_context({"http://r0": {DISK: whole}, "http://r1": {HOST: whole}, "http://r2": {DEVICE: whole}})
    policy, fleet = make_policy("kv", ctx), replicas(4)
    decision = policy.choose(request, fleet)
    assert (decision.replica.url, decision.reason, decision.match) == ("http://r2", "kv_hit", KVMatch(device=17))
    decision = policy.choose(request, fleet[:2] + fleet[3:])  # no pool hit among the candidates
    assert (decision.replica.url, decision.reason, decision.match) == ("http://r1", "kv_tier_hit", KVMatch(host=17))
    decision = policy.choose(request, [fleet[0], fleet[3]])
    assert (decision.replica.url, decision.reason, decision.match) == ("http://r0", "kv_tier_hit", KVMatch(disk=17))
    assert policy.choose(request, [fleet[3]]).reason == "cache_miss"


def test_kv_policy_counts_a_pool_run_continued_from_a_tier() -> None:
    request = view(3)
    hashes = list(request.block_hashes)
    # r0: 4 blocks in the pool, the rest on host (evicted from the pool, kept in host memory);
    # r1: 10 pool blocks and nothing beyond. 4 + 0.9 * 13 > 10.
    ctx = _tiered_context({"http://r0": {DEVICE: hashes[:4], HOST: hashes}, "http://r1": {DEVICE: hashes[:10]}})
    decision = make_policy("kv", ctx).choose(request, replicas(2))
    assert decision.replica.url == "http://r0" and decision.match == KVMatch(device=4, host=13)
    assert decision.matched_blocks == 17 and decision.reason == "kv_tier_hit"


def test_kv_policy_load_still_outweighs_a_weak_tier_hit() -> None:
    request = view(3)
    ctx = _tiered_context({"http://r0": {DISK: list(request.block_hashes)}})
    policy, fleet = make_policy("kv", ctx), replicas(2)
    fleet[0].in_flight = 3  # penalty 0.375 < 0.5 (a whole prompt on disk)
    assert policy.choose(request, fleet).replica.url == "http://r0"
    fleet[0].in_flight = 5  # penalty 0.625: the idle replica computes it sooner
    decision = policy.choose(request, fleet)
    assert decision.replica.url == "http://r1" and decision.reason == "cache_miss"


def test_tier_weights_are_settings_and_validated() -> None:
    request = view(3)
    equal = PolicySettings(host_hit_weight=1.0, disk_hit_weight=1.0)
    ctx = _tiered_context(
        {"http://r0": {DISK: list(request.block_hashes)}, "http://r1": {DEVICE: list(request.block_hashes)}}, equal
    )
    fleet = replicas(2)
    fleet[1].in_flight = 1  # a tier block worth a pool block: the idler replica wins
    assert make_policy("kv", ctx).choose(request, fleet).replica.url == "http://r0"
    with pytest.raises(ValueError, match="disk_hit_weight <= host_hit_weight"):
        PolicySettings(host_hit_weight=0.5, disk_hit_weight=0.7)
    with pytest.raises(ValueError, match="host_hit_weight <= 1"):
        PolicySettings(host_hit_weight=1.5)
    with pytest.raises(SystemExit, match="servelm router: tier weights must satisfy"):
        main(["router", "--kv-disk-hit-weight", "0.95"])  # above the host default: refused before starting
