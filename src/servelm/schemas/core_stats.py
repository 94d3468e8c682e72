"""CoreStats: the engine core's state after a step, sent to the API process with each OutputBatch
(servelm.engine.messages) and read there by the metrics (servelm.obs.metrics) and admission."""

from __future__ import annotations

import msgspec

# A waiting request counts as queued (what --max-waiting-requests bounds, server/admission.py) once
# it has waited this long. A prompt the scheduler holds back a step or two so that the streams
# beside it keep their token gap (step pricing) starts within a few steps; counted at once, a burst
# of 40 tiny prompts on an idle server with 64 free seats and a waiting limit of 4 had its last 7
# turned away with 429 on a host where each step admitted only part of it.
QUEUED_AFTER_S = 0.5


class TierStats(msgspec.Struct, kw_only=True):
    """KV tiers beyond the pool, by medium ("host", "disk"). Cumulative, but the bytes gauges and
    num_loading."""

    queries: dict[str, int] = {}  # tokens looked up in the tier after the pool and nearer tiers missed
    hits: dict[str, int] = {}  # ... and loaded from it
    loaded_bytes: dict[str, int] = {}  # moved into the pool
    saved_bytes: dict[str, int] = {}  # moved out of the pool
    used_bytes: dict[str, int] = {}
    capacity_bytes: dict[str, int] = {}
    failed_loads: int = 0  # loads that stopped short: timed out, or a block missing or corrupt
    num_loading: int = 0  # requests waiting for their prefix's KV to load (tier loads and pulls)
    num_pulling: int = 0  # ... of them pulling it from a prefill worker (disaggregation, decode side)
    num_exports: int = 0  # prompts whose KV a prefill worker holds for a pull (disaggregation, prefill side)


class CoreStats(msgspec.Struct, kw_only=True):
    """Scheduler state after a step, for gauges and counters on the API side."""

    num_running: int = 0
    num_waiting: int = 0
    num_queued: int = 0  # of them, those waiting QUEUED_AFTER_S or more
    num_prefilling: int = 0  # running prompts mid-prefill (partial prefills)
    kv_usage: float = 0.0  # fraction of KV blocks held by requests
    num_used_blocks: int = 0
    prefix_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # cumulative tokens found there
    prefix_evicted_misses: int = 0  # cumulative tokens missed there because their blocks were evicted
    num_preemptions: int = 0  # cumulative
    # cumulative hashed blocks evicted from the prefix cache, by the tenant whose request cached them
    prefix_evictions_by_tenant: dict[str, int] = {}
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters); all 0 without it.
    spec_num_drafts: int = 0  # request-steps that verified drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []  # [j]: drafts at position j (0-based) accepted
    tiers: TierStats = msgspec.field(default_factory=lambda: TierStats())  # empty without KV tiers
    # (scheduled tokens, runner seconds) of every step since the previous batch, mid-prefill
    # steps included (they send no outputs), for the step histograms.
    recent_steps: list[tuple[int, float]] = []
    # (kind, predicted seconds, measured seconds) of those steps the step-cost model predicted; kind
    # "decode" (no prompt work), "shallow" or "deep" (a chunk after 1,024+ tokens of its prompt).
    recent_predictions: list[tuple[str, float, float]] = []
    step_target_s: float = 0.0  # the step-time target before any class tightens it (0: none)
    # Structured outputs, cumulative: requests that asked for them, grammars compiled (cache misses)
    # and the seconds those compiles took; and the token-mask fills of the steps since the last batch.
    structured_requests: int = 0
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    recent_mask_fills: list[float] = []
