"""Per request: serve it whole on one replica, or split its prefill onto a prefill worker.

    candidates ──(not prefill-only)──▶ policy.choose ──▶ decode worker D, match(D)
        not one generation (n > 1, a batch, prompt scoring, an unread body) ─▶ aggregated on D: not_generation
        D cannot pull KV (a plain replica)                                   ─▶ aggregated on D: plain_decode_worker
        uncached(D) = prompt tokens - matched blocks(D) × block size
        uncached(D) < min_uncached_tokens ─▶ aggregated on D: short_prompt (the prompt is short)
                                                              cached_on_decode (D holds most of it)
        producers other than D: none                       ─▶ aggregated on D: no_prefill_worker
        all at max_prefill_load in-flight prefills         ─▶ aggregated on D: prefill_saturated
        else ─▶ prefill on P = most matched blocks, then fewest in-flight prefills, then least load;
                decode on D: disaggregated

Why a threshold on the *uncached* tokens of the chosen decode worker: a split costs a second
HTTP hop, a transfer and a second scheduling round, so it pays only where the prefill it moves
is long enough to stall D's running streams. A prompt D mostly holds already is cheap there;
one a prefill worker holds is not a reason to split (D would pull what it lacks anyway, and the
KV-aware choice of P already favours it). A prefill worker at its in-flight limit would queue
the prefill behind others and double TTFT (vLLM #21037): then D computes the prompt itself.

A prefill-only replica is never a candidate for a whole request. Nothing here does I/O or
changes state except what `policy.choose` records (see RoutingPolicy): `plan_request` is the
pure function the proxy calls once per attempt, and the unit tests call directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from servelm.kv.block_hash import BlockHash
from servelm.router.kv_index import KVMatch
from servelm.router.policies import Decision, RequestView, RoutingPolicy, rendezvous
from servelm.router.replicas import Replica

DISAGGREGATED = "disaggregated"
# Every reason a request is served whole; the metric's label values.
AGGREGATED_REASONS = (
    "not_generation", "plain_decode_worker", "short_prompt", "cached_on_decode", "no_prefill_worker",
    "prefill_saturated", "disabled", "retry",
)  # fmt: skip


@dataclass(frozen=True)
class DisaggSettings:
    enabled: bool = True  # False: every request whole (prefill-only replicas still get none)
    min_uncached_tokens: int = 512  # split only when the decode worker would compute at least this many
    max_prefill_load: int = 4  # in-flight prefill calls per prefill worker before it counts as saturated

    def __post_init__(self) -> None:
        if self.min_uncached_tokens < 1 or self.max_prefill_load < 1:
            raise ValueError(
                "disagg min_uncached_tokens and max_prefill_load must be >= 1, got "
                f"{self.min_uncached_tokens}, {self.max_prefill_load}"
            )


@dataclass(frozen=True)
class DisaggPlan:
    """Where one attempt goes. `route` is the routing policy's choice of the replica that answers
    the client (the decode worker, or the one serving the request whole)."""

    route: Decision
    reason: str  # DISAGGREGATED or one of AGGREGATED_REASONS
    prefill: Replica | None = None  # set exactly when disaggregated
    prefill_match: KVMatch = KVMatch()  # the prompt blocks the prefill worker already holds
    uncached_tokens: int = 0  # prompt tokens the decode worker would have computed itself

    @property
    def decode(self) -> Replica:
        return self.route.replica

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    @property
    def decision(self) -> str:
        return "disaggregated" if self.disaggregated else "aggregated"


def whole_request_candidates(replicas: Sequence[Replica]) -> list[Replica]:
    """The replicas that may answer a client: all but prefill-only ones."""
    return [r for r in replicas if r.serves_aggregated]


def plan_request(
    view: RequestView,
    replicas: Sequence[Replica],
    policy: RoutingPolicy,
    match: Callable[[str, Sequence[BlockHash]], KVMatch],
    settings: DisaggSettings,
    block_size: int,
    retry: bool = False,
) -> DisaggPlan | None:
    """Decide one attempt (module doc). `replicas`: the healthy candidates of this attempt;
    `match`: a replica's cached prompt blocks (the kv index's lookup). None when no replica may
    answer the request (only prefill-only ones are left). A `retry` (the first attempt failed
    before its first byte) is served whole. Calls `policy.choose` exactly once."""
    whole = whole_request_candidates(replicas)
    if not whole:
        return None
    # Before choose: a policy may record the request as cached where it sends it (prefix).
    cached = {r.url: match(r.url, view.block_hashes) if view.block_hashes else KVMatch() for r in whole}
    route = policy.choose(view, whole)
    decode = route.replica

    def aggregated(reason: str, uncached: int = 0) -> DisaggPlan:
        return DisaggPlan(route, reason, uncached_tokens=uncached)

    if retry:
        return aggregated("retry")
    if not settings.enabled:
        return aggregated("disabled")
    if not view.single_generation or view.num_prompt_tokens == 0:
        return aggregated("not_generation")
    if not decode.is_consumer:
        return aggregated("plain_decode_worker")
    uncached = max(0, view.num_prompt_tokens - cached[decode.url].num_blocks * block_size)
    if uncached < settings.min_uncached_tokens:
        return aggregated(
            "short_prompt" if view.num_prompt_tokens < settings.min_uncached_tokens else "cached_on_decode", uncached
        )
    producers = [r for r in replicas if r.is_producer and r is not decode]
    if not producers:
        return aggregated("no_prefill_worker", uncached)
    available = [r for r in producers if r.prefills_in_flight < settings.max_prefill_load]
    if not available:
        return aggregated("prefill_saturated", uncached)
    scored = [(match(r.url, view.block_hashes) if view.block_hashes else KVMatch(), r) for r in available]
    prefill_match, prefill = max(
        scored,
        key=lambda item: (item[0].num_blocks, -item[1].prefills_in_flight, -item[1].in_flight,
                          rendezvous(view.routing_key, item[1].url)),
    )  # fmt: skip
    return DisaggPlan(route, DISAGGREGATED, prefill, prefill_match, uncached)
