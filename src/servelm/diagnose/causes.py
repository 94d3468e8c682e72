"""Baseline vs current: which TTFT component grew, and which cause that growth belongs to.

    1. Did TTFT grow beyond noise (Noise)? If not: `none`.
    2. Each TTFT component's growth (mean seconds per request, current − baseline) goes to one cause:

         ingress     → frontend     (parse, chat template, tokenize in the API process)
         output      → output       (core→API, detokenize, SSE write: the streaming path)
         network     → network      (client TTFT − server TTFT)
         preemption  → kv_cache     (waiting after a preemption, recomputing lost work)
         kv_load     → kv_cache     (loading a prefix's KV from host memory or disk before the first step)
         kv_transfer → disaggregation (pulling the prompt's KV from a prefill worker: its prefill and the hop)
         grammar     → grammar      (structured outputs: the core compiling a request's grammar before it is queued)
         queue       → load         when the load grew (LOAD_GROWTH: arrival rate, the typical prompt,
                                    or output tokens per request), else
                       kv_cache     when the KV cache was the limit (preemptions rose, usage near full), else
                       scheduler    (short requests waited behind others' prefills)
         prefill     → load         when the load grew, else
                       kv_cache     when evictions cost prompts their cached prefixes (recompute: the share
                                    of reusable prefix tokens missed on evicted blocks rose by 0.1; from
                                    servers without that count, the hit rate fell with evictions up), else
                       output       (queue too) when outputs piled up in the API (OUTPUT_BACKLOG): streams
                                    not read; their backlog's CPU slows the engine's steps on a small host, else
                       scheduler    (long prompts' chunks share the steps: longer steps, more tokens per step)

       Load is checked first: more requests, or longer ones across the board, present exactly as
       queue and prefill growth, and the fix is capacity, not scheduling. A mix change (a few long
       documents among the same short requests) moves the mean prompt, not the median: scheduler.
    3. Causes rank by the seconds per request they explain; the top one is the diagnosis.
    4. TTFT within noise: the same question for the time between tokens (the mean TBT, the
       client's from bench.json in both windows, else the server's inter-token latency, which the
       API measures as its streams take their outputs; the mean, not a percentile: a stream read
       late takes its tokens in bursts, many gaps near 0 and a few long ones, and its time per
       token is what grew). Its growth goes to one cause:

         steps grew (engine step mean x STEP_GROWTH)  → load when the load grew, else scheduler,
                                                        unless outputs piled up and the steps' growth
                                                        is under STEPS_EXPLAIN of the gaps' growth
         outputs pile up in the API (OUTPUT_BACKLOG)  → output   (streams not read: slow clients; on
                                                        2 cores their backlog also slows the steps:
                                                        CI's slow-readers window had steps x1.56,
                                                        +4 ms, against the client's gaps +26 ms)
         the API event loop runs late (lag p99 x 2)   → frontend
         none of these, on the client's figure        → network  when the server kept pace (its own gaps
                                                        grew by under SERVER_SHARE of the client's), else output

       "Steps grew" is x STEP_GROWTH, or any growth that makes up STEPS_EXPLAIN of the gaps' growth
       where the server's own gaps grew with the client's (decode over longer contexts: a token's
       step grows by less than x1.5 but is most of what its gap grew).

       A stream that its client does not read delays no other stream's tokens in servelm (each
       stream has its own queue), so slow readers show here, or in step 2 only through the CPU
       their backlog takes from the engine (2 cores: the 2026-12 slow-readers scenario grew
       prefill by ~0.7 s with outputs piled up and the same traffic).

Without a TTFT split (an older server, vLLM's metrics) the whole growth goes to the first of
load, kv_cache, scheduler whose signals moved (scheduler when none did: the queue is its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelm.diagnose.signals import COMPONENTS, Signals

CAUSES = ("scheduler", "kv_cache", "output", "network", "frontend", "load", "disaggregation", "grammar", "none")
STEP_GROWTH = 1.5  # engine steps this much longer (mean): the gaps between tokens are the steps
STEPS_EXPLAIN = 0.5  # ...when their growth is at least this share of the gaps' growth (see steps_explain_tbt)
SERVER_SHARE = 0.5  # the server's own gaps grew by this share of the client's: not the path (server_gaps_grew)
OUTPUT_BACKLOG = 10.0  # outputs queued in the API (max over the window) that count as a pile-up, if 2x the baseline
LOAD_GROWTH = 1.5  # rate or request size up by this factor: the same queueing is simply more work
KV_USAGE_FULL = 0.9
HIT_RATE_DROP = 0.1  # absolute fall of prefix hits / queries that counts as "the cache lost its prefixes"
PREFIX_LOSS_RISE = 0.1  # ... or, where the server counts misses on evicted blocks, the same rise of prefix_loss_rate

KNOBS = {
    "scheduler": "cap long prompts' chunks (--long-prefill-token-threshold), let more prompts prefill at once "
    "(--max-num-partial-prefills), bound step time (--max-step-ms); give long-document traffic its own tenant "
    "and SLO class (--tenants) so short requests are ordered ahead of it",
    "kv_cache": "more KV memory (--kv-cache-memory GiB or --num-blocks), fewer concurrent requests "
    "(--max-num-seqs), keep prefix caching on and shared prefixes hot (smaller per-tenant working sets)",
    "output": "the streaming path: clients that do not read their streams back up the per-stream output queue; "
    "fix the readers (or cut them off), spread streams over more API processes",
    "network": "the path between client and server (proxies, load balancer, TLS, distance, packet loss): compare "
    "the client's TTFT with the server's x-servelm-ttft-breakdown",
    "frontend": "the API process: chat-template and tokenization cost of long re-sent histories "
    "(--tokenizer-threads, shorter histories, more API processes)",
    "load": "capacity: more replicas behind `servelm router`, or shed load earlier (--max-waiting-requests)",
    "disaggregation": "the prefill pool or the KV transfer: more prefill workers, a higher "
    "--disagg-min-uncached-tokens on the router (fewer prompts sent to prefill workers), a faster link",
    "grammar": "structured outputs' grammar compiles: reuse schemas (compiled ones are cached), keep them small, "
    "or --structured-outputs-backend guidance (no up-front compile)",
}

EVIDENCE = {
    "scheduler": ("ttft.queue", "ttft.prefill", "waiting_mean", "step_time_mean_s", "step_time_p90_s",
                  "tokens_per_step_mean", "partial_prefills_mean", "prompt_tokens_per_request", "prompt_tokens_p50"),
    "kv_cache": ("ttft.preemption", "ttft.queue", "ttft.prefill", "preemptions_per_s", "kv_usage_mean",
                 "kv_usage_max", "prefix_hit_rate", "prefix_evictions_per_s", "prefix_loss_rate"),
    "output": ("ttft.output", "output_backlog_mean", "outputs_queued_mean", "outputs_queued_max", "loop_lag_mean_s"),
    "network": ("ttft.network", "client_ttft_mean_s", "ttft_p90_s"),
    "frontend": ("ttft.ingress", "loop_lag_mean_s", "loop_lag_p99_s", "prompt_tokens_per_request"),
    "load": ("ttft.queue", "ttft.prefill", "request_rate", "prompt_tokens_p50", "prompt_tokens_per_request",
             "uncached_prompt_tokens_per_request",
             "generation_tokens_per_request", "prompt_tokens_per_s", "waiting_mean"),
    "disaggregation": ("ttft.kv_transfer", "ttft.queue", "ttft_p90_s"),
    "grammar": ("ttft.grammar", "ttft.queue", "ttft_p90_s"),
    "none": ("ttft_p50_s", "ttft_p90_s"),
}  # fmt: skip
FIXED_CAUSE = {
    "ingress": "frontend", "output": "output", "network": "network", "preemption": "kv_cache", "kv_load": "kv_cache",
    "kv_transfer": "disaggregation", "grammar": "grammar",
}  # fmt: skip


@dataclass(frozen=True)
class Noise:
    """TTFT grew when the mean rose by more than min_ratio of the baseline AND more than min_seconds."""

    min_ratio: float = 0.2
    min_seconds: float = 0.05

    def __post_init__(self) -> None:
        if self.min_ratio < 0 or self.min_seconds < 0:
            raise ValueError(f"noise thresholds must be >= 0, got {self}")

    def grew(self, baseline: float, current: float) -> bool:
        growth = current - baseline
        return growth > self.min_seconds and growth > self.min_ratio * baseline


TBT_NOISE = Noise(min_ratio=0.2, min_seconds=0.01)  # gaps are tens of ms: 10 ms is already felt


@dataclass(frozen=True)
class Evidence:
    signal: str
    baseline: float | None
    current: float | None

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.current is None or self.baseline == 0:
            return None
        return self.current / self.baseline

    def to_dict(self) -> dict[str, Any]:
        return {"signal": self.signal, "baseline": self.baseline, "current": self.current, "ratio": self.ratio}


@dataclass
class Cause:
    name: str
    explains_s: float  # TTFT growth per request (seconds) put down to this cause
    components: list[str]  # the TTFT components whose growth it explains
    evidence: list[Evidence]
    knob: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "explains_s": self.explains_s,
            "components": self.components,
            "evidence": [e.to_dict() for e in self.evidence],
            "knob": self.knob,
        }


@dataclass
class Diagnosis:
    baseline: Signals
    current: Signals
    causes: list[Cause]  # ranked, the top first
    ttft_grew: bool
    notes: list[str] = field(default_factory=list)
    latency: str = "ttft"  # what the causes explain: "ttft", or "tbt" when only the time between tokens grew

    @property
    def top_cause(self) -> str:
        return self.causes[0].name


def signal_value(signals: Signals, name: str) -> float | None:
    """`ttft.<component>` for a component, `ttft_mean_s`, or a named signal."""
    if name.startswith("ttft."):
        return signals.components.get(name.removeprefix("ttft."))
    if name == "ttft_mean_s":
        return signals.ttft_mean_s
    return signals.values.get(name)


def _grew(baseline: Signals, current: Signals, name: str, factor: float) -> bool:
    before, after = signal_value(baseline, name), signal_value(current, name)
    if after is None or after <= 0 or before is None:
        return False
    return after >= factor * before if before > 0 else True


def load_grew(baseline: Signals, current: Signals) -> bool:
    """More requests, longer outputs, or the typical prompt longer AND more work: a history re-sent
    from the prefix cache makes the prompt longer but not the prefill (where the server reports its
    cache hits, the prompt must also have grown in tokens it had to compute)."""
    if any(_grew(baseline, current, name, LOAD_GROWTH) for name in ("request_rate", "generation_tokens_per_request")):
        return True
    uncached_known = signal_value(current, "uncached_prompt_tokens_per_request") is not None
    return _grew(baseline, current, "prompt_tokens_p50", LOAD_GROWTH) and (
        not uncached_known or _grew(baseline, current, "uncached_prompt_tokens_per_request", LOAD_GROWTH)
    )


def kv_limited(baseline: Signals, current: Signals) -> bool:
    usage = signal_value(current, "kv_usage_max")
    full = usage is not None and usage >= KV_USAGE_FULL and usage > (signal_value(baseline, "kv_usage_max") or 0.0)
    return full or _grew(baseline, current, "preemptions_per_s", 2.0)


def prefixes_lost(baseline: Signals, current: Signals) -> bool:
    """Evictions cost prompts their cached prefixes. Measured directly where the server counts
    misses on blocks it had evicted (prefix_loss_rate); else inferred from a falling hit rate with
    evictions up, which new unique prompts (long documents: they hit nothing) also make fall."""
    loss_before, loss_after = signal_value(baseline, "prefix_loss_rate"), signal_value(current, "prefix_loss_rate")
    if loss_before is not None and loss_after is not None:
        return loss_after - loss_before >= PREFIX_LOSS_RISE
    before, after = signal_value(baseline, "prefix_hit_rate"), signal_value(current, "prefix_hit_rate")
    fell = before is not None and after is not None and before - after >= HIT_RATE_DROP
    return fell and _grew(baseline, current, "prefix_evictions_per_s", 2.0)


def cause_of(component: str, baseline: Signals, current: Signals) -> str:
    if component in FIXED_CAUSE:
        return FIXED_CAUSE[component]
    if load_grew(baseline, current):
        return "load"
    kv = kv_limited(baseline, current) if component == "queue" else prefixes_lost(baseline, current)
    if kv:
        return "kv_cache"
    # The same traffic, but streams not read pile outputs up in the API: holding and encoding that
    # backlog takes CPU the engine's steps share on a small host, so prompts prefill slower too.
    return "output" if outputs_piled_up(baseline, current) else "scheduler"


def tbt_signal(baseline: Signals, current: Signals) -> str | None:
    """The TBT figure both windows have: the client's (what users see) before the server's."""
    for name in ("client_tbt_mean_s", "itl_mean_s"):
        if signal_value(baseline, name) is not None and signal_value(current, name) is not None:
            return name
    return None


def outputs_piled_up(baseline: Signals, current: Signals) -> bool:
    after = signal_value(current, "outputs_queued_max")
    before = signal_value(baseline, "outputs_queued_max") or 0.0
    return after is not None and after >= OUTPUT_BACKLOG and after >= 2 * before


def _growth(baseline: Signals, current: Signals, name: str) -> float | None:
    """current - baseline of a signal; None where either window lacks it."""
    before, after = signal_value(baseline, name), signal_value(current, name)
    return None if before is None or after is None else after - before


def steps_explain_tbt(baseline: Signals, current: Signals, measured_by: str) -> bool:
    """Did the steps' own growth make up at least STEPS_EXPLAIN of the time-between-tokens growth?
    A token takes at least one step, so longer steps lengthen every gap by as much; a gap that grew
    far more than the steps did grew somewhere else (a client reading late sees its own gaps)."""
    steps, gaps = _growth(baseline, current, "step_time_mean_s"), _growth(baseline, current, measured_by)
    if steps is None or gaps is None:
        return True  # nothing to weigh them by: the steps' growth stands
    return steps >= STEPS_EXPLAIN * gaps


def server_gaps_grew(baseline: Signals, current: Signals, measured_by: str) -> bool:
    """Did the server's own gaps (the API's inter-token latency) grow by at least SERVER_SHARE of
    what the client saw? Then the time was lost before the API took the tokens, not on the path.
    Without the client's figure, the server's is the one measured."""
    if measured_by != "client_tbt_mean_s":
        return True
    server, client = _growth(baseline, current, "itl_mean_s"), _growth(baseline, current, measured_by)
    return server is not None and client is not None and server >= SERVER_SHARE * client


def tbt_cause(baseline: Signals, current: Signals, measured_by: str) -> str:
    piled_up = outputs_piled_up(baseline, current)
    in_server = server_gaps_grew(baseline, current, measured_by)
    steps_explain = steps_explain_tbt(baseline, current, measured_by)
    # Steps that grew x STEP_GROWTH lengthen every gap; so do steps that grew less, where the
    # server's gaps grew with the client's and the steps make up most of it (decode rows attending
    # over longer histories: steps x1.43 for gaps x1.6, the long-histories scenario on Zen 3).
    steps_grew = _grew(baseline, current, "step_time_mean_s", STEP_GROWTH) or (
        in_server and _grew(baseline, current, "step_time_mean_s", 1.0) and steps_explain
    )
    if steps_grew and (not piled_up or steps_explain):
        return "load" if load_grew(baseline, current) else "scheduler"
    if piled_up:
        return "output"
    if _grew(baseline, current, "loop_lag_p99_s", 2.0):
        return "frontend"
    return "output" if in_server else "network"


def _cause(
    name: str, explains_s: float, components: list[str], baseline: Signals, current: Signals, latency: str = "ttft"
) -> Cause:
    measured = ("ttft_mean_s",) if latency == "ttft" else ("client_tbt_mean_s", "itl_mean_s", "step_time_mean_s")
    evidence = [
        Evidence(signal, signal_value(baseline, signal), signal_value(current, signal))
        for signal in dict.fromkeys((*measured, *EVIDENCE[name]))
    ]
    shown = [e for e in evidence if e.baseline is not None or e.current is not None]
    return Cause(name, explains_s, components, shown, KNOBS.get(name))


def diagnose(baseline: Signals, current: Signals, noise: Noise | None = None) -> Diagnosis:
    """Compare two windows' signals (see the module doc for the rules); never raises on absent signals."""
    noise = noise or Noise()
    notes = [*baseline.notes, *(n for n in current.notes if n not in baseline.notes)]
    before, after = baseline.ttft_mean_s, current.ttft_mean_s
    if before is None or after is None:
        notes.append("TTFT is unknown in one window: nothing to explain")
        return Diagnosis(baseline, current, [_cause("none", 0.0, [], baseline, current)], False, notes)
    if not noise.grew(before, after):
        return _diagnose_tbt(baseline, current, notes)
    explained: dict[str, tuple[float, list[str]]] = {}
    for component in COMPONENTS:
        old, new = baseline.components.get(component), current.components.get(component)
        if old is None or new is None or new <= old:
            continue
        seconds, names = explained.get(name := cause_of(component, baseline, current), (0.0, []))
        explained[name] = (seconds + new - old, [*names, component])
    if not explained:
        notes.append("no TTFT split in these windows: the whole growth is put down to the signals that moved")
        name = cause_of("queue", baseline, current)
        explained[name] = (after - before, [])
    causes = [_cause(name, seconds, names, baseline, current) for name, (seconds, names) in explained.items()]
    causes.sort(key=lambda cause: cause.explains_s, reverse=True)
    return Diagnosis(baseline, current, causes, True, notes)


def _diagnose_tbt(baseline: Signals, current: Signals, notes: list[str]) -> Diagnosis:
    """Step 4 (module doc): TTFT held; did the time between tokens grow, and why?"""
    measured_by = tbt_signal(baseline, current)
    if measured_by is not None:
        before, after = signal_value(baseline, measured_by), signal_value(current, measured_by)
        assert before is not None and after is not None  # tbt_signal checked both
        if TBT_NOISE.grew(before, after):
            name = tbt_cause(baseline, current, measured_by)
            notes.append(f"TTFT held; the time between tokens grew ({measured_by}): the causes explain that")
            cause = _cause(name, after - before, ["tbt"], baseline, current, latency="tbt")
            return Diagnosis(baseline, current, [cause], False, notes, latency="tbt")
    return Diagnosis(baseline, current, [_cause("none", 0.0, [], baseline, current)], False, notes)
