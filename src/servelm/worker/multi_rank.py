"""Multi-rank workers: the engine core's runner is rank 0 and drives ranks 1..N-1 step by step.

    engine core process (rank 0)                      follower process (rank r), one per rank
      Scheduler.schedule() → SchedulerOutput
      StepBroadcaster.send(so) ──ZMQ PUSH, pickled──▶ PULL: so
      ModelRunner.execute(so)                          ModelRunner.execute(so)   (output dropped)
          model forward ◀══ torch.distributed collectives (all-reduce, all-gather, ring) ══▶
          logits, sampling → ModelOutput
      Scheduler.update(...)

Every rank runs the same ModelRunner code on the same SchedulerOutput, so every rank issues the
same collectives in the same order; only rank 0's output counts (its sampler decides the tokens,
which reach the others in the next SchedulerOutput, as they reach a single runner). The schedule
goes over ZMQ, not a collective: a follower waits for the next step without a deadline (an idle
server sends nothing), while every collective has one (`ParallelConfig.distributed_timeout_s`).

Failure: a step that fails on any rank leaves the ranks out of step (one stopped before a
collective the others entered), and there is no safe way back, so it is fatal: `RankFailedError`
ends the engine core, which tells the API process (every in-flight request fails with the
error; /health turns 503). A follower that dies is noticed before the next step (its process
exited) or inside the step (the collective fails when its peer's socket closes, or times out).
Followers exit when rank 0 goes away (they watch its pid) or sends None.

Followers are started as `python -m servelm.worker.rank_main` subprocesses (the engine core is a
daemon process, which multiprocessing does not let have children), their launch spec pickled
on stdin.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

import torch
import torch.distributed as dist
import zmq

from servelm.attention.backend import AttentionBackend
from servelm.attention.kv_storage import LayerKVCache
from servelm.config import EngineConfig
from servelm.datatypes import SchedulerOutput
from servelm.models.factory import build_model, resolve_device, resolve_dtype
from servelm.models.llama import LlamaForCausalLM
from servelm.models.loader import LoadedCheckpoint
from servelm.models.sharding import ModelShard, local_num_kv_heads
from servelm.parallel.context_backend import ContextParallelBackend
from servelm.parallel.context_layout import AttentionHeads
from servelm.parallel.groups import ParallelGroups, ParallelLayout, default_backend
from servelm.parallel.shm_collectives import process_alive
from servelm.ports import free_port
from servelm.worker.kv_cache import allocate_kv_caches, resolve_kv_dtype
from servelm.zmq_contexts import non_lingering_context

logger = logging.getLogger(__name__)

# How often an idle follower checks that rank 0 still exists.
PARENT_POLL_MS = 1000
# How long close() waits for followers to exit before killing them.
CLOSE_TIMEOUT_S = 10.0


class RankFailedError(RuntimeError):
    """A rank died, or a step failed on some rank: the ranks cannot be brought back in step."""


@dataclass(frozen=True)
class RankLaunch:
    """What a follower needs to build its shard and join; pickled onto its stdin."""

    config: EngineConfig
    rank: int
    init_method: str  # torch.distributed rendezvous (tcp://127.0.0.1:PORT)
    step_address: str  # where it binds its PULL socket for rank 0's steps
    num_blocks: int  # rank 0 sized the KV pool: every rank allocates exactly this many blocks
    max_model_len: int
    driver_pid: int  # rank 0's process: the follower exits when it is gone


@dataclass
class RankShard:
    """One rank's part of the engine: its model shard and its KV pool."""

    model: LlamaForCausalLM
    kv_caches: list[LayerKVCache]


def layout_of(config: EngineConfig) -> ParallelLayout:
    parallel = config.parallel
    return ParallelLayout(parallel.tensor_parallel_size, parallel.context_parallel_size)


def threads_per_rank(config: EngineConfig) -> int:
    if config.parallel.threads_per_rank is not None:
        return config.parallel.threads_per_rank
    return max(1, (os.cpu_count() or 1) // config.parallel.world_size)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """CPU ranks share the machine; CUDA rank r takes device r (one node)."""
    device = resolve_device(config.model.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def check_supported(config: EngineConfig) -> None:
    """What multi-rank workers do not do yet, refused with the reason instead of misbehaving: the one
    place that says so (engine/builder.py assembles one rank and many the same way after it; CUDA
    decode graphs are simply off with several ranks)."""
    if config.parallel.world_size == 1:
        return
    speculative = config.speculative
    if speculative is not None and speculative.method == "draft":
        raise ValueError(
            "--speculative-config method 'draft' is not supported with -tp/-cp > 1 yet (the draft's forwards "
            "would have to run on every rank); use ngram or suffix"
        )
    if config.kv_tiers.enabled or config.kv_transfer.kv_role is not None:
        raise ValueError(
            "KV tiers and --kv-role are not supported with -tp/-cp > 1 yet (each rank holds only its shard of a block)"
        )
    if config.lora.enable_lora:
        raise ValueError("--enable-lora is not supported with -tp/-cp > 1 yet (adapters run on one rank)")


def build_shard(
    config: EngineConfig, checkpoint: LoadedCheckpoint, groups: ParallelGroups, num_blocks: int, device: torch.device
) -> RankShard:
    """This rank's model (its tensor-parallel shard, read from the lazily loaded `checkpoint`: no
    rank reads another's) and its KV pool: `num_blocks` physical blocks of `config.cache.block_size`
    tokens, this rank's KV heads. The checkpoint's weights are dropped once read."""
    dtype = resolve_dtype(config.model.dtype, device)
    arch = checkpoint.arch
    backend: str | AttentionBackend = config.model.attention_backend
    if groups.cp.is_parallel:
        # Its choice between the ring and gathering queries weighs this rank's heads (after TP).
        attention = ModelShard.of(arch, groups.tp).attention
        heads = AttentionHeads(attention.num_heads, attention.num_kv_heads, arch.head_dim)
        backend = ContextParallelBackend(groups.cp, heads)
    model = build_model(arch, checkpoint.weights, dtype, device, backend, tp=groups.tp,
                        gemm_precision=config.model.gemm_precision)  # fmt: skip
    del checkpoint.weights
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, device)
    kv_caches = allocate_kv_caches(
        arch, num_blocks, config.cache.block_size, kv_dtype, device, num_kv_heads=local_num_kv_heads(arch, groups.tp)
    )
    return RankShard(model, kv_caches)


# -- rank 0 --------------------------------------------------------------------------------


class StepBroadcaster:
    """Rank 0's side: starts the followers, sends them every step, notices when one is gone."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.layout = layout_of(config)
        self._context = non_lingering_context()
        self._sockets: list[zmq.Socket] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        self._failure: str | None = None
        self._directory = tempfile.mkdtemp(prefix="servelm-ranks-")
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(1, self.layout.world_size):
            address = f"ipc://{self._directory}/rank-{rank}"
            launch = RankLaunch(config, rank, self.init_method, address, num_blocks, max_model_len, os.getpid())
            self._processes.append(_start_follower(launch))
            push = self._context.socket(zmq.PUSH)
            push.connect(address)  # queued until the follower binds: nothing is lost
            self._sockets.append(push)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def check_alive(self) -> None:
        """Raise RankFailedError when a follower has exited (or a step already failed)."""
        if self._failure is None:
            for rank, process in enumerate(self._processes, start=1):
                code = process.poll()
                if code is not None:
                    self._failure = f"rank {rank} (pid {process.pid}) exited with code {code}"
                    break
        if self._failure is not None:
            raise RankFailedError(f"multi-rank worker is down: {self._failure}")

    def send(self, scheduler_output: SchedulerOutput) -> None:
        self.check_alive()
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        for push in self._sockets:
            push.send(payload, copy=False)

    def failed(self, reason: str) -> None:
        """A step failed on rank 0: the ranks are out of step for good."""
        self._failure = self._failure or reason

    def close(self) -> None:
        """Tell the followers to exit; kill those that do not within CLOSE_TIMEOUT_S."""
        if self._failure is None:
            for push in self._sockets:
                push.send(pickle.dumps(None))
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for process in self._processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()) if self._failure is None else 0.1)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for push in self._sockets:
            push.close(linger=0)
        self._context.term()
        shutil.rmtree(self._directory, ignore_errors=True)  # the followers' ipc socket files
        if dist.is_initialized():  # rank 0 joined the world in this process: leave it (another engine may join)
            dist.destroy_process_group()


def _start_follower(launch: RankLaunch) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-m", "servelm.worker.rank_main"], stdin=subprocess.PIPE)
    stdin: IO[bytes] | None = process.stdin
    assert stdin is not None
    stdin.write(pickle.dumps(launch))
    stdin.close()
    return process


# -- every rank ----------------------------------------------------------------------------


def join_world(config: EngineConfig, rank: int, init_method: str, device: torch.device) -> ParallelGroups:
    torch.set_num_threads(threads_per_rank(config))
    backend = config.parallel.distributed_backend
    return ParallelGroups.initialize(
        layout_of(config),
        rank,
        init_method,
        default_backend(device) if backend == "auto" else backend,
        config.parallel.distributed_timeout_s,
        shared_memory=config.parallel.shared_memory_collectives,
    )


# -- ranks 1..N-1 --------------------------------------------------------------------------


def receive_steps(address: str) -> zmq.Socket:
    """The follower's PULL socket for rank 0's steps."""
    pull: zmq.Socket = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(address)
    return pull


def next_step(pull: zmq.Socket, driver_pid: int) -> SchedulerOutput | None:
    """Block until rank 0 sends a step; None when it says stop or is gone."""
    while not pull.poll(PARENT_POLL_MS):
        if not process_alive(driver_pid):
            logger.error("rank 0 (pid %d) is gone: exiting", driver_pid)
            return None
    step: SchedulerOutput | None = pickle.loads(pull.recv())
    return step
