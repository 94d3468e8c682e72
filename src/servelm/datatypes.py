"""The objects that cross component boundaries.

    API process ──EngineRequest──▶ EngineCore ──SchedulerOutput──▶ ModelRunner
    API process ◀──EngineOutput─── EngineCore ◀────ModelOutput───── ModelRunner

Messages that cross a process boundary (EngineRequest, EngineOutput and what they
hold) are msgspec Structs: one serialisation mechanism. Objects that stay inside the
core process (SchedulerOutput, ModelOutput) are plain dataclasses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from servelm.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # the client went away or asked
    ERROR = "error"  # the engine failed


class EventType(str, enum.Enum):
    """Timestamped hand-offs a request records; timelines and metrics derive from them."""

    ARRIVED = "arrived"  # accepted by the engine core
    QUEUED = "queued"  # entered the waiting queue (again, after a preemption)
    SCHEDULED = "scheduled"  # a step included it (first time or after a preemption)
    PREFILL_CHUNK = "prefill_chunk"  # one chunk of prompt computed
    PREEMPTED = "preempted"  # lost its blocks; will recompute
    FIRST_TOKEN = "first_token"  # first output token sampled
    SPEC_VERIFIED = "spec_verified"  # drafts verified in a step; detail = how many were accepted
    KV_LOAD_STARTED = "kv_load_started"  # its prefix's KV is being loaded from a tier; detail = tokens
    KV_LOADED = "kv_loaded"  # the load ended; detail = tokens that arrived (the rest is computed)
    # Disaggregation, consumer side: the pull of its prompt's KV from a prefill worker started
    # (detail = tokens asked for) / ended (detail = tokens that arrived; the rest is computed).
    KV_PULL_STARTED = "kv_pull_started"
    KV_PULLED = "kv_pulled"
    GRAMMAR_READY = "grammar_ready"  # structured outputs: its grammar compiled (it waited for that)
    FINISHED = "finished"


class RequestEvent(msgspec.Struct, array_like=True):
    type: EventType
    timestamp: float  # time.time() in the core process (wall clock: comparable across processes)
    detail: int = 0  # e.g. tokens in a prefill chunk


class RequestSlo(msgspec.Struct, frozen=True, kw_only=True):
    """Who sent a request and what latency its class promises: set by the API from the tenants
    config (`--tenants`), read by the scheduler (deadline order, fair share, step-time target)
    and by metrics (tenant/class labels). Targets None: the class promises nothing."""

    tenant: str = "default"
    slo_class: str = "default"
    ttft_target_s: float | None = None  # the class's time to first token target
    tbt_target_s: float | None = None  # the class's time between tokens target
    weight: float = 1.0  # the tenant's share among tenants of its class (fair share divides service by it)
    # How long its KV blocks stay in the tiers beyond the pool (KV_RETENTIONS): its class's, or the
    # request's `kv_retention` hint.
    kv_retention: str = "normal"
    # Whether waiting lifts it a priority per aging_s (scheduler/ranking.py). False for the batch
    # class, which fills the capacity interactive traffic leaves idle: lifted, a line that waited
    # would take steps from voice requests that waited less, and a batch has hours to finish.
    ages: bool = True


DEFAULT_SLO = RequestSlo()

# KV retention in the host/disk tiers (kv/tier_index.py): "low" blocks are evicted first and stay
# so; "normal" ones move up once reused; "high" ones (system prompts, shared documents) go last.
KV_RETENTIONS = ("low", "normal", "high")


class KVTransferRole(str, enum.Enum):
    PRODUCER = "producer"  # compute the prompt, keep its KV for a consumer's pull (vLLM: do_remote_decode)
    CONSUMER = "consumer"  # pull the prompt's KV from `peer`, then decode (vLLM: do_remote_prefill)


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    """One side of a prefill/decode hand-off, from the API's `kv_transfer_params` (servelm.disagg).

    The router gives both sides the same `transfer_id`; the consumer pulls the prompt's blocks by
    their hashes (which it computes from its own tokens) under that id from the producer's
    transfer server at `peer`."""

    transfer_id: str
    role: KVTransferRole
    peer: str | None = None  # consumer: the producer's transfer address, "tcp://host:port"


class EngineRequest(msgspec.Struct, kw_only=True):
    """A request as the engine core receives it: already tokenized."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower value runs first (vLLM convention); 0 interactive, larger = batch
    arrival_time: float = 0.0  # time.time() when the API process received it
    cache_salt: str | None = None  # isolates prefix caching between tenants
    slo: RequestSlo = DEFAULT_SLO
    kv_transfer: KVTransferParams | None = None  # disaggregation: this request's side of a hand-off
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int  # 1 = most likely


class PositionLogprobs(msgspec.Struct, array_like=True):
    """The chosen token at one position, and the top alternatives there."""

    chosen: TokenLogprob
    top: list[TokenLogprob]


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one step produced for one request; the API process accumulates these."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first position has none
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    events: list[RequestEvent] = []
    error: str | None = None


# ---------------------------------------------------------------------------
# KV beyond the pool (servelm.kv.tiers decides, servelm.worker.kv_offload moves the bytes)


class KVMedium(str, enum.Enum):
    """Where a KV block sits (the values are vLLM's KV-event medium names, lower-cased)."""

    DEVICE = "device"  # the engine's pool (L1), on whatever device the runner uses
    HOST = "host"  # host memory (L2)
    DISK = "disk"  # a directory, perhaps shared by replicas (L3)
    REMOTE = "remote"  # a prefill worker's host tier, pulled over the transfer (disaggregation)


@dataclass(frozen=True)
class KVSave:
    """Copy pool block `block_id` (computed, full, hashed `block_hash`) out to `media`."""

    block_id: int
    block_hash: bytes
    media: tuple[KVMedium, ...]


@dataclass(frozen=True)
class KVLoad:
    """Fill pool blocks `block_ids` (allocated to `request_id`, not yet sent to the runner) with
    the stored blocks `block_hashes`, block i from `media[i]`, in order, in the background."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    media: list[KVMedium]
    peer: KVPeer | None = None  # media REMOTE: where and under which transfer id to pull them


@dataclass(frozen=True)
class KVPeer:
    """A producer's transfer server and the transfer a consumer pulls from it."""

    address: str  # "tcp://host:port"
    transfer_id: str


@dataclass(frozen=True)
class KVExport:
    """Producer: the blocks `block_hashes` (the prompt's full blocks, in order) of transfer
    `transfer_id` will be in the host tier as they are computed: serve them to its pull."""

    transfer_id: str
    block_hashes: list[bytes]


class KVExportEnd(str, enum.Enum):
    """Why an export changes state (KVTransfers.export_ends)."""

    COMPLETE = "complete"  # the prompt is computed: every block that will be saved has been ordered
    ABORTED = "aborted"  # the prefill failed or was aborted: pulls get what is there, then "missing"
    EXPIRED = "expired"  # not pulled within kv_transfer_hold_s: forgotten (pulls fail at once)


@dataclass(frozen=True)
class KVDrop:
    """Forget the stored block `block_hash` in `medium` (its tier evicted it)."""

    block_hash: bytes
    medium: KVMedium


@dataclass
class KVTransfers:
    """One step's KV movement orders. The runner applies them in this order, before the forward:
    cancels (a cancelled load writes nothing more), saves (the blocks' bytes are intact until this
    step's forward), drops, then starts the loads."""

    cancels: list[str] = field(default_factory=list)  # request ids whose load must stop
    saves: list[KVSave] = field(default_factory=list)
    drops: list[KVDrop] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)
    # Disaggregation, producer side (applied after the saves): transfers announced, and
    # (transfer_id, why) for those that changed state.
    exports: list[KVExport] = field(default_factory=list)
    export_ends: list[tuple[str, KVExportEnd]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.cancels or self.saves or self.drops or self.loads or self.exports or self.export_ends)


@dataclass(frozen=True)
class KVLoadResult:
    """A load that ended: its first `num_blocks_loaded` blocks hold the stored KV (a prefix: loading
    stops at the first block that fails). `failure` says why it stopped short, None when complete."""

    request_id: str
    num_blocks_loaded: int
    num_bytes: int  # moved into the pool
    seconds: float  # from start to end of the load
    media: tuple[KVMedium, ...]  # the medium of each loaded block
    failure: str | None = None  # "cancelled" | "missing" | "corrupt: ..." | an error's type


# ---------------------------------------------------------------------------
# Scheduler → runner (same process)


@dataclass
class NewRequestData:
    """A request the runner has not seen yet (or has dropped after a preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after a preemption
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table so far
    num_computed_tokens: int  # tokens whose KV is already in the blocks (prefix hit)
    lora_name: str | None = None  # its LoRA adapter (None: the base model)


@dataclass
class CachedRequestData:
    """A diff for a request the runner already mirrors."""

    request_id: str
    new_token_ids: list[int]  # tokens appended (sampled) since the runner last saw it
    new_block_ids: list[int]  # blocks appended to its block table
    num_computed_tokens: int  # before this step


@dataclass(frozen=True)
class LayerSlice:
    """Layers [start_layer, end_layer) of a prompt chunk of `num_tokens` tokens, the ones after the
    request's num_computed_tokens (layered prefill: one chunk's forward spread over several steps
    by layers, so that a step ends within its time target while the chunk keeps a size its matmuls
    run efficiently at). The runner holds the chunk's hidden states between its slices; the chunk's
    tokens count as computed only once its last layer ran."""

    num_tokens: int
    start_layer: int
    end_layer: int  # == the model's layer count: the chunk completes this step


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request_id → tokens to compute this step
    total_num_scheduled_tokens: int
    # Requests the runner must forget: finished, aborted or preempted since the last step.
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    # Speculative decoding: request_id → the k draft tokens it verifies this step. Its
    # num_scheduled_tokens is then 1 + k: its last token and the drafts after it, in one pass.
    scheduled_draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Most drafts the proposer should make for a request after this step (the controller's use
    # for them next step); missing: the configured num_speculative_tokens.
    num_drafts_wanted: dict[str, int] = field(default_factory=dict)
    # KV tiers: blocks to save, drop and load around this step (empty without tiers).
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)
    # Layered prefill: request_id → the layers of its in-flight chunk that run this step. A slice
    # that ends the chunk has its request in num_scheduled_tokens too (its num_tokens: the chunk
    # completes and is computed as any chunk would be); an earlier slice has not, and computes no
    # token the scheduler counts (total_num_scheduled_tokens leaves it out).
    layer_slices: dict[str, LayerSlice] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and self.kv_transfers.is_empty and not self.layer_slices

    @property
    def scheduled_request_ids(self) -> list[str]:
        """Every request the step computes something for: tokens, or layers of a chunk in flight."""
        return list(self.num_scheduled_tokens) + [rid for rid in self.layer_slices if rid not in self.num_scheduled_tokens]

    @property
    def has_work(self) -> bool:
        """Anything for the model to compute: tokens, or layers of an in-flight chunk."""
        return self.total_num_scheduled_tokens > 0 or bool(self.layer_slices)


# ---------------------------------------------------------------------------
# Runner → scheduler (same process)


@dataclass
class ModelOutput:
    """Per scheduled request: the token(s) sampled, empty when a prefill chunk ended mid-prompt.
    With drafts verified, the accepted drafts then the target's own next token (1..k+1 tokens)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
    # Wall seconds the runner spent on this step (inputs, forward, sampling, the copy back):
    # feeds the scheduler's step-cost model (max_step_ms) and the step histograms.
    execute_seconds: float = 0.0
    # Speculative decoding: drafts the proposer made after this step's sampling, for the next
    # step (request_id → up to num_speculative_tokens ids; missing: no guess).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Wall seconds of execute_seconds the proposer took to make them: a draft model's forwards are
    # the cost of drafting, which the goodput controller charges (and the step-cost fit leaves out).
    propose_seconds: float = 0.0
    # KV tiers: loads that ended since the previous step, and bytes written out per medium.
    kv_load_results: list[KVLoadResult] = field(default_factory=list)
    kv_saved_bytes: dict[KVMedium, int] = field(default_factory=dict)
    # Disaggregation, producer side: transfers whose every block has been sent since the last step.
    kv_exports_served: list[str] = field(default_factory=list)
