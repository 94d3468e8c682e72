"""The engine-core process: receive requests over ZMQ, step the model, send outputs back.

The loop never blocks while there is work: it drains whatever messages have arrived,
runs one step, sends that step's outputs as one batch. With nothing to do it waits on
the socket. Any exception ends the process after telling the client why (CoreFailed),
so the API side can fail every waiting request instead of hanging.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import zmq

from servelm import envs
from servelm.config import EngineConfig
from servelm.datatypes import EngineOutput, EngineRequest, FinishReason
from servelm.engine.builder import build_engine
from servelm.engine.core import EngineCore
from servelm.engine.kv_events import KVEventPublisher
from servelm.engine.lora_calls import LoRACalls
from servelm.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStarting,
    LoadLoRA,
    OutputBatch,
    Shutdown,
    UnloadLoRA,
    from_core_encoder,
    to_core_decoder,
)
from servelm.engine.step_trace import StepTrace
from servelm.obs.startup import StartupTimeline
from servelm.worker.host_residency import enable_huge_pages

logger = logging.getLogger(__name__)


# Idle poll interval while a prefill worker holds exports: how soon a pull served or a hold
# expired is heard of (an empty step each time; cheap).
HOUSEKEEPING_POLL_MS = 50
# Idle poll interval otherwise: how soon a core whose API process died (kill -9) notices, exits
# and frees its memory for a restarted server.
IDLE_POLL_MS = 250


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Process entry point (spawned by the client)."""
    # Ctrl-C in a terminal reaches the whole process group; the API process owns shutdown
    # (it drains in-flight requests, then sends Shutdown), so the core must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    enable_huge_pages()  # before this process's first tensor: PyTorch reads the switch once
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    kv_events: KVEventPublisher | None = None
    core: EngineCore | None = None
    # Each phase is announced as it begins (the API's /ready says where start-up is) and all of them
    # go with CoreReady.
    startup = StartupTimeline(on_phase=lambda name: outputs.send(from_core_encoder.encode(CoreStarting(name))))
    try:
        built = build_engine(config, startup=startup)
        core = built.core
        if config.kv_events.kv_events_port is not None:  # the events switch (KVEventsConfig.enabled)
            # Bound before the first step, so it sees every event the cache records.
            kv_events = KVEventPublisher(
                context, config.kv_events.kv_events_host, config.kv_events.kv_events_port,
                built.core.kv_manager.block_size, built.core.scheduler.take_kv_events,
            )  # fmt: skip
        outputs.send(
            from_core_encoder.encode(
                CoreReady(
                    max_model_len=built.max_model_len,
                    num_blocks=built.num_blocks,
                    block_size=built.core.kv_manager.block_size,  # logical blocks under context parallelism
                    vocab_size=built.arch.vocab_size,
                    source=built.source,
                    kv_transfer_address=built.kv_transfer_address,
                    startup=startup.records,
                )
            )
        )
        trace_path = envs.step_trace_path()
        trace = StepTrace(trace_path, built) if trace_path is not None else None
        try:
            _serve(built.core, inputs, outputs, kv_events, trace)
        finally:
            if trace is not None:
                trace.close()
    except Exception:
        outputs.send(from_core_encoder.encode(CoreFailed(error=traceback.format_exc(limit=8))))
        raise
    finally:
        if core is not None:
            core.close()  # the KV tiers' last saves reach the disk
        if kv_events is not None:
            kv_events.close()
        outputs.close(linger=1000)
        inputs.close(linger=0)
        context.term()


def _serve(
    core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, kv_events: KVEventPublisher | None = None,
    trace: StepTrace | None = None,
) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    lora_calls = LoRACalls(core)
    if kv_events is not None:
        kv_events.register(poller)
    parent = os.getppid()
    warming = False  # a keep-warm pass is mid-way: its next slice comes after a look at the inputs
    while True:
        rejected: list[EngineOutput] = []
        # With work pending (or a keep-warm pass to go on with), only drain what is already there;
        # otherwise wait (bounded, to notice orphaning; shorter while exports wait for their pulls,
        # which only a step hears of).
        housekeeping = core.has_housekeeping() or lora_calls.pending
        timeout_ms = 0 if core.has_work() or warming else HOUSEKEEPING_POLL_MS if housekeeping else IDLE_POLL_MS
        while ready := dict(poller.poll(timeout_ms)):
            timeout_ms = 0
            if kv_events is not None:
                kv_events.handle(ready)  # a snapshot request, answered between steps so it is exact
            if inputs not in ready:
                continue
            message = to_core_decoder.decode(inputs.recv())
            if isinstance(message, Shutdown):
                return
            if isinstance(message, AddRequest):
                rejection = _add_request(core, message.request)
                if rejection is not None:
                    rejected.append(rejection)
            elif isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
            elif isinstance(message, (LoadLoRA, UnloadLoRA)) and (reply := lora_calls.handle(message)) is not None:
                outputs.send(from_core_encoder.encode(reply))
            timeout_ms = 0
        for reply in lora_calls.finished():
            outputs.send(from_core_encoder.encode(reply))
        if os.getppid() != parent:
            logger.error("engine core: the API process is gone; exiting")
            return
        gauges = core.transfer_gauges()
        started = time.perf_counter()
        step_outputs = rejected
        if core.has_work() or core.has_housekeeping():  # housekeeping: an empty step
            step_outputs = rejected + core.step()
        changed = core.transfer_gauges() != gauges
        if kv_events is not None:
            kv_events.publish()  # this step's stored / removed blocks, or an idle heartbeat
        if step_outputs or changed:
            stats = core.stats()
            stats.recent_steps = core.take_step_records()
            stats.recent_predictions = core.take_step_predictions()
            stats.recent_mask_fills = core.take_mask_fills()
            batch = OutputBatch(outputs=step_outputs, stats=stats, timestamp=time.time())
            outputs.send(from_core_encoder.encode(batch))
        if trace is not None:
            trace.write(core, time.perf_counter() - started)
        # After the outputs went out: a slice (~2 ms) delays the next step, not this one.
        warming = core.keep_warm()


def _add_request(core: EngineCore, request: EngineRequest) -> EngineOutput | None:
    """Queue a request; a request the scheduler refuses fails alone instead of ending the core."""
    try:
        core.add_request(request)
    except ValueError as error:
        return EngineOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=str(error)
        )
    return None
