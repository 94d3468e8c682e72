"""Messages between the API process and the engine-core process (msgspec, msgpack on the wire).

    API ──PUSH──▶ core:  AddRequest | AbortRequests | LoadLoRA | UnloadLoRA | Shutdown
    API ◀──PUSH── core:  CoreStarting (per start-up phase) | CoreReady (once) | OutputBatch (per step)
                         | LoRAReply (per LoadLoRA / UnloadLoRA, once done) | CoreFailed
"""

from __future__ import annotations

import msgspec

from servelm.config import LoRAModule
from servelm.datatypes import EngineOutput, EngineRequest
from servelm.obs.startup import PhaseRecord
from servelm.schemas.core_stats import CoreStats


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class LoadLoRA(msgspec.Struct, tag="load_lora"):
    call_id: int  # echoed by its LoRAReply
    module: LoRAModule


class UnloadLoRA(msgspec.Struct, tag="unload_lora"):
    call_id: int
    name: str


class LoRAReply(msgspec.Struct, tag="lora_reply"):
    call_id: int
    status: int = 200  # the HTTP status it maps to: 200 done, 400 refused (error says why), 404 unknown name
    error: str | None = None


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class CoreStarting(msgspec.Struct, tag="starting"):
    phase: str  # the start-up phase the core just entered (servelm.obs.startup.PHASES)


class CoreReady(msgspec.Struct, tag="ready", kw_only=True):
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    source: str
    kv_transfer_address: str | None = None  # a producer's transfer server (disaggregation)
    startup: list[PhaseRecord] = []  # the core's start-up phases, in the order they began


class OutputBatch(msgspec.Struct, tag="outputs", kw_only=True):
    outputs: list[EngineOutput]
    stats: CoreStats
    timestamp: float  # time.time() in the core when the batch was sent


class CoreFailed(msgspec.Struct, tag="failed"):
    error: str


ToCore = AddRequest | AbortRequests | LoadLoRA | UnloadLoRA | Shutdown
FromCore = CoreStarting | CoreReady | OutputBatch | LoRAReply | CoreFailed

to_core_encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_encoder = msgspec.msgpack.Encoder()
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
