"""The prefill/decode split decision (router/disagg.py) on synthetic fleets, with the real kv
policy and kv index (fed snapshots), no I/O."""

from __future__ import annotations

import pytest

from servelm.kv.block_hash import hash_block_tokens
from servelm.router.disagg import AGGREGATED_REASONS, DisaggSettings, plan_request
from servelm.router.kv_index import KVIndex
from servelm.router.policies import PolicyContext, RequestView, make_policy
from servelm.router.replicas import Replica, ReplicaSpec
from servelm.schemas.kv_events import KVSnapshot

BLOCK = 16
SETTINGS = DisaggSettings(min_uncached_tokens=512, max_prefill_load=2)


def replica(name: str, role: str | None) -> Replica:
    address = f"tcp://{name}:9000" if role in ("prefill", "both") else None
    return Replica(ReplicaSpec(f"http://{name}"), healthy=True, kv_role=role, transfer_address=address)


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 30000 for i in range(num_tokens)]


def view_of(tokens: list[int], single_generation: bool = True) -> RequestView:
    hashes = hash_block_tokens(tokens, BLOCK)
    key = hashes[0] if hashes else b"k"
    return RequestView(hashes, len(tokens), 16, None, key, single_generation=single_generation)


class Fleet:
    """Replicas, the real kv policy and the index it reads."""

    def __init__(self, *replicas: Replica) -> None:
        self.replicas = list(replicas)
        self.context = PolicyContext(kv_index=KVIndex())
        self.policy = make_policy("kv", self.context)

    def holds(self, url: str, tokens: list[int]) -> None:
        snapshot = KVSnapshot(epoch="e", seq=1, block_size=BLOCK, block_hashes=hash_block_tokens(tokens, BLOCK))
        self.context.kv_index.apply_snapshot(url, snapshot)

    def plan(self, view: RequestView, settings: DisaggSettings = SETTINGS, retry: bool = False):
        return plan_request(
            view, self.replicas, self.policy, self.context.kv_index.lookup, settings, BLOCK, retry=retry
        )


def test_long_uncached_prompt_is_split_onto_the_prefill_worker() -> None:
    fleet = Fleet(replica("p", "prefill"), replica("d", "decode"))
    plan = fleet.plan(view_of(prompt(1000)))
    assert plan is not None and plan.disaggregated and plan.reason == "disaggregated"
    assert (plan.prefill.url, plan.decode.url) == ("http://p", "http://d")
    assert plan.uncached_tokens == 1000 and plan.decision == "disaggregated"


def test_short_prompt_stays_on_the_decode_worker() -> None:
    fleet = Fleet(replica("p", "prefill"), replica("d", "decode"))
    plan = fleet.plan(view_of(prompt(100)))
    assert plan is not None and not plan.disaggregated
    assert (plan.reason, plan.decode.url, plan.decision) == ("short_prompt", "http://d", "aggregated")


def test_threshold_is_inclusive_and_counts_uncached_tokens_only() -> None:
    fleet = Fleet(replica("p", "prefill"), replica("d", "decode"))
    assert fleet.plan(view_of(prompt(512))).disaggregated
    assert fleet.plan(view_of(prompt(511))).reason == "short_prompt"
    tokens = prompt(1000)
    fleet.holds("http://d", tokens[:512])  # 32 of 62 full blocks cached on d: 488 left to compute
    plan = fleet.plan(view_of(tokens))
    assert (plan.reason, plan.uncached_tokens) == ("cached_on_decode", 488)
    fleet.holds("http://d", tokens[:480])  # 30 blocks: 520 left, over the threshold again
    assert fleet.plan(view_of(tokens)).disaggregated


def test_mostly_cached_prompt_stays_where_it_is_cached() -> None:
    # Two decode workers; the kv policy sends the prompt to the one holding it: nothing to split.
    fleet = Fleet(replica("p", "prefill"), replica("d0", "decode"), replica("d1", "decode"))
    tokens = prompt(2000, seed=3)
    fleet.holds("http://d1", tokens[:1984])
    plan = fleet.plan(view_of(tokens))
    assert (plan.reason, plan.decode.url, plan.prefill) == ("cached_on_decode", "http://d1", None)


def test_saturated_prefill_pool_serves_whole() -> None:
    prefill0, prefill1 = replica("p0", "prefill"), replica("p1", "prefill")
    fleet = Fleet(prefill0, prefill1, replica("d", "decode"))
    prefill0.prefills_in_flight = 2
    assert fleet.plan(view_of(prompt(1000))).prefill is prefill1  # p0 at the limit: the other
    prefill1.prefills_in_flight = 2
    plan = fleet.plan(view_of(prompt(1000)))
    assert (plan.reason, plan.decode.url, plan.prefill) == ("prefill_saturated", "http://d", None)


def test_no_prefill_worker_and_plain_decode_workers() -> None:
    assert Fleet(replica("d", "decode")).plan(view_of(prompt(1000))).reason == "no_prefill_worker"
    assert Fleet(replica("a", None), replica("p", "prefill")).plan(view_of(prompt(1000))).reason == (
        "plain_decode_worker"
    )
    # A producer without a transfer address (not yet known) is no prefill worker.
    unreachable = Replica(ReplicaSpec("http://p"), healthy=True, kv_role="prefill")
    assert Fleet(unreachable, replica("d", "decode")).plan(view_of(prompt(1000))).reason == "no_prefill_worker"


def test_prefill_only_replica_never_gets_a_whole_request() -> None:
    prefill = replica("p", "prefill")
    fleet = Fleet(prefill, replica("d", "decode"))
    for tokens, generation in ((prompt(10), True), (prompt(1000), False), (prompt(600), True), ([], True)):
        for retry in (False, True):
            plan = fleet.plan(view_of(tokens, generation), retry=retry)
            assert plan.decode is not prefill
    assert Fleet(prefill).plan(view_of(prompt(1000))) is None


def test_not_generation_retry_and_disabled_serve_whole() -> None:
    fleet = Fleet(replica("p", "prefill"), replica("d", "decode"))
    assert fleet.plan(view_of(prompt(1000), single_generation=False)).reason == "not_generation"
    assert fleet.plan(view_of([])).reason == "not_generation"  # a body the router could not read
    assert fleet.plan(view_of(prompt(1000)), retry=True).reason == "retry"
    off = DisaggSettings(enabled=False)
    assert fleet.plan(view_of(prompt(1000)), settings=off).reason == "disabled"
    reasons = {"not_generation", "retry", "disabled", "short_prompt", "cached_on_decode", "no_prefill_worker"}
    assert reasons <= set(AGGREGATED_REASONS)


def test_prefill_worker_chosen_by_cache_then_load() -> None:
    prefill0, prefill1, both = replica("p0", "prefill"), replica("p1", "prefill"), replica("b", "both")
    fleet = Fleet(prefill0, prefill1, both, replica("d", "decode"))
    both.in_flight = 5  # busy: the decode worker is d, and b is a prefill candidate
    tokens = prompt(1500, seed=9)
    fleet.holds("http://p1", tokens[:320])
    plan = fleet.plan(view_of(tokens))
    assert (plan.prefill.url, plan.prefill_match.device) == ("http://p1", 20)
    fleet.holds("http://p1", [])
    prefill0.prefills_in_flight = 1
    assert fleet.plan(view_of(tokens)).prefill.url == "http://p1"  # b ties on prefills, loses on load
    prefill1.prefills_in_flight = 1
    assert fleet.plan(view_of(tokens)).prefill.url == "http://b"


def test_a_both_worker_is_never_its_own_prefill_worker() -> None:
    fleet = Fleet(replica("b", "both"))
    assert fleet.plan(view_of(prompt(1000))).reason == "no_prefill_worker"
    fleet = Fleet(replica("b0", "both"), replica("b1", "both"))
    plan = fleet.plan(view_of(prompt(1000)))
    assert plan.disaggregated and plan.prefill is not plan.decode


def test_settings_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="min_uncached_tokens"):
        DisaggSettings(min_uncached_tokens=0)
    with pytest.raises(ValueError, match="max_prefill_load"):
        DisaggSettings(max_prefill_load=0)
