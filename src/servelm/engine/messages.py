"""Messages between the API process and the engine-core process (msgspec, msgpack on the wire).

    API ──PUSH──▶ core:  AddRequest | AbortRequests | Shutdown
    API ◀──PUSH── core:  CoreReady (once) | OutputBatch (per step) | CoreFailed
"""

from __future__ import annotations

import msgspec

from servelm.datatypes import EngineOutput, EngineRequest


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class CoreStats(msgspec.Struct, kw_only=True):
    """Scheduler state after a step, for gauges and counters on the API side."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks held by requests
    num_used_blocks: int = 0
    prefix_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # cumulative tokens found there
    num_preemptions: int = 0  # cumulative
    # (scheduled tokens, runner seconds) of every step since the previous batch, mid-prefill
    # steps included (they send no outputs), for the step histograms.
    recent_steps: list[tuple[int, float]] = []


class CoreReady(msgspec.Struct, tag="ready", kw_only=True):
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    source: str


class OutputBatch(msgspec.Struct, tag="outputs", kw_only=True):
    outputs: list[EngineOutput]
    stats: CoreStats
    timestamp: float  # time.time() in the core when the batch was sent


class CoreFailed(msgspec.Struct, tag="failed"):
    error: str


ToCore = AddRequest | AbortRequests | Shutdown
FromCore = CoreReady | OutputBatch | CoreFailed

to_core_encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_encoder = msgspec.msgpack.Encoder()
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
