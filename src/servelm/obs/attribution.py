"""Where one request's time to first token went.

    received ──ingress──▶ sent_to_core ──grammar + queue + kv_load──▶ first scheduled ──prefill + preemption──▶ first_token ──output──▶ end
      (API)   parse,          (API)     IPC in +     (core)        chunks; lost time while      (core)    core→API, detokenize,  (API)
              template,                 waiting                    preempted, and the chunks             SSE write
              tokenize                  queue                      that redo work done before it

`grammar` is the part of the wait before the first schedule the core spent compiling the request's
structured-output grammar (ARRIVED → GRAMMAR_READY: it is not queued before that). `kv_load` is the part of the wait before the first schedule spent loading the prompt's prefix
from a KV tier (host memory, disk: KV_LOAD_STARTED → KV_LOADED); `kv_transfer` the part spent
pulling the prompt's KV from a prefill worker (disaggregation: KV_PULL_STARTED → KV_PULLED; the
pull streams blocks as the prefill computes them, so it holds the remote prefill and the transfer
hop after it); `queue` is the rest.

The components telescope, so they sum to `end - received` exactly (in wall-clock time;
`ttft_mono` is the same span on the API's monotonic clock, the cross-check for a clock step).

Preemption before the first token is charged two ways: the wall time from PREEMPTED to the
next SCHEDULED (waiting again), and the share of later prefill chunks that recompute tokens
already computed before the preemption (a prefix-cache hit on the old blocks shrinks the
chunks, so this is an upper bound on the recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.datatypes import EventType, RequestEvent
from servelm.schemas.ttft import TTFT_COMPONENTS


@dataclass(frozen=True)
class TTFTBreakdown:
    """Seconds. ingress + grammar + queue + kv_load + kv_transfer + prefill + preemption + output == ttft."""

    ingress: float  # HTTP received → sent to the core: validation, chat template, tokenization
    grammar: float  # sent → its structured-output grammar compiled in the core (0 for free text)
    queue: float  # sent → first scheduled, less kv_load: IPC into the core and the waiting queue
    kv_load: float  # before the first schedule: its prefix's KV loading from a tier beyond the pool
    kv_transfer: float  # before the first schedule: its prompt's KV pulled from a prefill worker
    prefill: float  # first scheduled → first token, less preemption: prompt compute (chunks, batch-mates)
    preemption: float  # waiting after preemptions + recomputing lost progress, before the first token
    output: float  # first token sampled in the core → end: core→API, detokenize, write
    ttft: float  # received → end, wall clock
    ttft_mono: float  # received → end on the API's monotonic clock
    core_to_api: float  # first token sampled → its output received by the API (part of `output`)
    detokenize: float  # received → detokenized (part of `output`)

    COMPONENTS = TTFT_COMPONENTS

    def as_ms(self) -> dict[str, float]:
        names = (*self.COMPONENTS, "ttft", "ttft_mono", "core_to_api", "detokenize")
        return {name: round(getattr(self, name) * 1000.0, 3) for name in names}

    def header_value(self) -> str:
        """`x-servelm-ttft-breakdown`: `ingress=0.412;queue=1.03;…;ttft=5.9` in milliseconds."""
        return ";".join(f"{k}={v:.3f}" for k, v in self.as_ms().items())


def attribute_ttft(
    *,
    received: float,
    sent_to_core: float,
    first_output_received: float,
    first_token_detokenized: float,
    end: float,
    ttft_mono: float,
    events: list[RequestEvent],
) -> TTFTBreakdown | None:
    """Split received → end; None when the core events lack a SCHEDULED or FIRST_TOKEN."""
    first_scheduled = next((e.timestamp for e in events if e.type is EventType.SCHEDULED), None)
    first_token = next((e.timestamp for e in events if e.type is EventType.FIRST_TOKEN), None)
    if first_scheduled is None or first_token is None:
        return None
    compute = first_token - first_scheduled
    preemption = min(preemption_before(events, first_token), max(compute, 0.0))
    waited = first_scheduled - sent_to_core
    kv_load = min(kv_load_before(events, first_scheduled), max(waited, 0.0))
    kv_transfer = min(kv_load_before(events, first_scheduled, PULL_EVENTS), max(waited - kv_load, 0.0))
    grammar_ready = next((e.timestamp for e in events if e.type is EventType.GRAMMAR_READY), None)
    grammar = min(max(grammar_ready - sent_to_core, 0.0), max(waited - kv_load - kv_transfer, 0.0)) if grammar_ready else 0.0
    return TTFTBreakdown(
        ingress=sent_to_core - received,
        grammar=grammar,
        queue=waited - kv_load - kv_transfer - grammar,
        kv_load=kv_load,
        kv_transfer=kv_transfer,
        prefill=compute - preemption,
        preemption=preemption,
        output=end - first_token,
        ttft=end - received,
        ttft_mono=ttft_mono,
        core_to_api=first_output_received - first_token,
        detokenize=first_token_detokenized - first_output_received,
    )


LOAD_EVENTS = (EventType.KV_LOAD_STARTED, EventType.KV_LOADED)  # from a tier
PULL_EVENTS = (EventType.KV_PULL_STARTED, EventType.KV_PULLED)  # from a prefill worker


def kv_load_spans(
    events: list[RequestEvent], kind: tuple[EventType, EventType] = LOAD_EVENTS
) -> list[tuple[float, float]]:
    """(start, end) of each KV load of `kind` (a tier's by default, or PULL_EVENTS) in a request's events."""
    spans, started = [], None
    begin, end = kind
    for event in events:
        if event.type is begin:
            started = event.timestamp
        elif event.type is end and started is not None:
            spans.append((started, event.timestamp))
            started = None
    return spans


def kv_load_before(events: list[RequestEvent], until: float, kind: tuple[EventType, EventType] = LOAD_EVENTS) -> float:
    """Seconds spent in KV loads of `kind` that ended by `until`."""
    return sum(end - start for start, end in kv_load_spans(events, kind) if end <= until)


def preemption_before(events: list[RequestEvent], until: float) -> float:
    """Seconds lost to preemption up to `until` (see module doc for the two parts)."""
    lost = 0.0
    computed = 0  # prompt tokens computed since the request last (re)started
    high_water = 0  # most prompt tokens any run got through: everything below it is redo work
    redo = 0  # tokens still to recompute in the current run
    preempted_at: float | None = None
    boundary: float | None = None  # end of the previous chunk, or the SCHEDULED that began this run
    for event in events:
        if event.timestamp > until or event.type is EventType.FIRST_TOKEN:
            break
        if event.type is EventType.PREEMPTED:
            high_water = max(high_water, computed)
            preempted_at, redo, computed = event.timestamp, high_water, 0
        elif event.type is EventType.SCHEDULED:
            if preempted_at is not None:
                lost += event.timestamp - preempted_at
                preempted_at = None
            boundary = event.timestamp
        elif event.type is EventType.PREFILL_CHUNK and boundary is not None:
            if redo > 0 and event.detail > 0:
                share = min(redo, event.detail)
                lost += (event.timestamp - boundary) * share / event.detail
                redo -= share
            computed += event.detail
            boundary = event.timestamp
    return lost
