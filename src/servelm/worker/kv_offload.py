"""KV beyond the pool, the worker's half: copies blocks between the pool and host memory (L2) and
disk (L3) as the scheduler orders (KVTransfers in each SchedulerOutput; kv/tiers.py decides).

A block's bytes are the [:, block_id] slices of the runner's block tensors (every pool tensor whose
dim 1 is the block id: per layer K/V, and scales where the KV dtype has them), packed in order into
one uint8 payload:

    payload = K/V of layer 0 | K/V of layer 1 | ... | (scales ...)         (block_bytes bytes)

Threads, so transfers overlap the model's forward:
- saves are copied out synchronously in `apply`, before the step's forward (the scheduler may
  have handed the block to another request whose forward overwrites it); disk files are then
  written by the writer thread from that host copy;
- loads run on the loader thread, block by block, into pool blocks no scheduled request reads
  (they belong to a request that waits for them); a cancel waits for the block being copied, so
  after `apply` returns a cancelled load writes nothing more: the scheduler may reuse its blocks.

Disaggregation (servelm.disagg), with a KVTransferConfig role:
- producer: the host store is what the transfer server serves; exports announced and ended by the
  scheduler go to the export registry, every host save wakes the pulls waiting for it, and the
  exports whose pull ended are reported back (`take_served`);
- consumer: a load from the REMOTE medium is a pull on the transfer client's I/O thread (many at
  once: one waits for its prefill while another completes); each verified block is copied into
  its pool block under the same lock and cancel rules as a tier load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servelm.config import KVTransferConfig
from servelm.datatypes import KVLoad, KVLoadResult, KVMedium, KVTransfers
from servelm.disagg.exports import ExportRegistry
from servelm.disagg.transport_client import KVTransferClient
from servelm.disagg.transport_server import KVTransferServer
from servelm.kv.disk_store import CorruptBlockFile, DiskBlockStore

logger = logging.getLogger(__name__)

# Disk writes waiting for the writer thread at most; beyond, new saves to disk are skipped (a
# slow or full disk must not grow host memory without bound: a skipped block is a later miss).
MAX_PENDING_DISK_WRITES = 4096


@dataclass
class _LoadJob:
    load: KVLoad
    started: float = 0.0
    num_loaded: int = 0  # blocks copied into the pool so far
    cancelled: bool = False
    reported: bool = False  # its result is out: the loader must not copy or report any more


class BlockCodec:
    """Packs one pool block into a uint8 payload and back (see the module docstring)."""

    def __init__(self, block_tensors: Sequence[torch.Tensor]) -> None:
        if not block_tensors:
            raise ValueError("no block tensors to move")
        self.tensors = list(block_tensors)
        self._spans: list[tuple[int, int]] = []  # per tensor: (byte offset, bytes) in the payload
        offset = 0
        for tensor in self.tensors:
            num_bytes = tensor[:, 0].numel() * tensor.element_size()
            if offset % tensor.element_size():
                raise ValueError(f"block tensor of {tensor.dtype} would sit at unaligned payload offset {offset}")
            self._spans.append((offset, num_bytes))
            offset += num_bytes
        self.block_bytes = offset

    def pack(self, block_id: int, payload: torch.Tensor) -> None:
        """Copy pool block `block_id` into `payload` (uint8 [block_bytes], host)."""
        for tensor, (offset, num_bytes) in zip(self.tensors, self._spans, strict=True):
            source = tensor[:, block_id]
            payload[offset : offset + num_bytes].view(tensor.dtype).view(source.shape).copy_(source)

    def unpack(self, payload: torch.Tensor, block_id: int) -> None:
        """Copy `payload` into pool block `block_id`."""
        for tensor, (offset, num_bytes) in zip(self.tensors, self._spans, strict=True):
            target = tensor[:, block_id]
            target.copy_(payload[offset : offset + num_bytes].view(tensor.dtype).view(target.shape))


class KVOffloader:
    """Host store, disk writer and background loader of one runner. `apply` and `take_results` are
    called by the runner's thread only; `close` stops the threads (pending disk writes first)."""

    def __init__(
        self,
        block_tensors: Sequence[torch.Tensor],
        disk_store: DiskBlockStore | None,
        transfer: KVTransferConfig | None = None,  # a disaggregation role; None or no role: none
        corrupt_every: int = 0,  # fault injection (tests): the transfer server corrupts every Nth block sent
    ) -> None:
        """Host copies are kept for the saves ordered to the host tier (the scheduler orders them
        only when there is one); `disk_store` is the disk tier, None without one. A producer's
        transfer server and a consumer's connections to `kv_transfer_peers` start here."""
        self.codec = BlockCodec(block_tensors)
        self._disk = disk_store
        self._pin = block_tensors[0].device.type == "cuda"  # page-locked host copies for fast DMA
        self._host: dict[bytes, torch.Tensor] = {}  # block hash → payload; read by the loader thread
        self._host_lock = threading.Lock()
        self._results: list[KVLoadResult] = []
        self._results_lock = threading.Condition()
        self._saved_bytes: dict[KVMedium, int] = {}
        self._jobs: dict[str, _LoadJob] = {}
        self._load_queue: queue.SimpleQueue[_LoadJob | None] = queue.SimpleQueue()
        self._busy_lock = threading.Lock()  # held by the loader while it copies one block
        self._loader = threading.Thread(target=self._load_loop, name="kv-loader", daemon=True)
        self._loader.start()
        self._write_queue: queue.Queue[tuple[str, bytes, torch.Tensor | None] | None] = queue.Queue(
            MAX_PENDING_DISK_WRITES
        )
        self._writer: threading.Thread | None = None
        if disk_store is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
            self._writer.start()
        self._exports: ExportRegistry | None = None
        self._server: KVTransferServer | None = None
        self._client: KVTransferClient | None = None
        if transfer is not None and transfer.is_producer:
            # A pull may arrive long before its producer request is announced: the engine core takes
            # new requests between steps, and a prefill worker's step or queue can take longer than
            # a heartbeat timeout (measured: a pull failing "unknown" after 5 s while the prefill
            # sat in the queue). A pull for an unannounced transfer waits as long as an export is held.
            self._exports = ExportRegistry(self._host_payload, transfer.kv_transfer_hold_s)
            self._server = KVTransferServer(
                self._exports, transfer.kv_transfer_host, transfer.kv_transfer_port, corrupt_every=corrupt_every
            )
        if transfer is not None and transfer.is_consumer:
            self._pull_timeout_s = transfer.kv_transfer_timeout_s
            self._client = KVTransferClient(
                self.codec.block_bytes, transfer.kv_transfer_wait_s, self._on_pulled_block, self._on_pull_end
            )
            for address in transfer.kv_transfer_peers:
                self._client.connect(address)

    @property
    def transfer_address(self) -> str | None:
        """Where consumers pull this producer's exports ("tcp://host:port"); None if not a producer."""
        return self._server.address if self._server is not None else None

    def host_hashes(self) -> set[bytes]:
        with self._host_lock:
            return set(self._host)

    # -- the runner's side ---------------------------------------------------------------

    def apply(self, transfers: KVTransfers) -> None:
        """Carry out one step's orders, before its forward (see KVTransfers for the order)."""
        for request_id in transfers.cancels:
            self._cancel(request_id)
        for save in transfers.saves:
            self._save(save.block_id, save.block_hash, save.media)
        for drop in transfers.drops:
            if drop.medium is KVMedium.HOST:
                with self._host_lock:
                    self._host.pop(drop.block_hash, None)
            elif self._disk is not None:
                self._enqueue_write("delete", drop.block_hash, None)
        if self._exports is not None:
            if transfers.saves:
                self._exports.notify_saved()
            for export in transfers.exports:
                self._exports.announce(export.transfer_id, export.block_hashes)
            for transfer_id, why in transfers.export_ends:
                self._exports.end(transfer_id, why)
        for load in transfers.loads:
            job = _LoadJob(load, started=time.perf_counter())
            self._jobs[load.request_id] = job
            if load.peer is not None:
                self._start_pull(job)
            else:
                self._load_queue.put(job)

    @property
    def has_loads_in_flight(self) -> bool:
        """A load (or pull) was started and its result not yet taken: its copies into the pool may
        still run on another thread."""
        return bool(self._jobs)

    def take_served(self) -> list[str]:
        """Producer: exports whose pull ended since the last call (the scheduler lets go of them)."""
        return self._exports.take_served() if self._exports is not None else []

    def take_results(self, wait_s: float = 0.0) -> list[KVLoadResult]:
        """Loads that ended since the last call; waits up to `wait_s` for one when none has (the
        runner waits only when it has nothing else to do)."""
        with self._results_lock:
            if not self._results and wait_s > 0 and self._jobs:
                self._results_lock.wait(wait_s)
            results, self._results = self._results, []
        for result in results:
            self._jobs.pop(result.request_id, None)
        return results

    def take_saved_bytes(self) -> dict[KVMedium, int]:
        with self._results_lock:
            saved, self._saved_bytes = self._saved_bytes, {}
        return saved

    def flush(self) -> None:
        """Wait until the disk writes and deletes ordered so far are done (tests; shutdown)."""
        if self._writer is not None:
            self._write_queue.join()

    def close(self) -> None:
        for request_id in list(self._jobs):
            self._cancel(request_id)
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.close()
        self._load_queue.put(None)
        self._loader.join(timeout=10)
        if self._writer is not None:
            self._write_queue.put(None)
            self._writer.join(timeout=60)

    # -- saves -------------------------------------------------------------------------

    def _save(self, block_id: int, block_hash: bytes, media: tuple[KVMedium, ...]) -> None:
        payload = torch.empty(self.codec.block_bytes, dtype=torch.uint8, pin_memory=self._pin)
        self.codec.pack(block_id, payload)
        if KVMedium.HOST in media:
            with self._host_lock:
                self._host[block_hash] = payload
            self._count_saved(KVMedium.HOST, self.codec.block_bytes)
        if KVMedium.DISK in media and self._disk is not None:
            self._enqueue_write("write", block_hash, payload)

    def _enqueue_write(self, operation: str, block_hash: bytes, payload: torch.Tensor | None) -> None:
        try:
            self._write_queue.put_nowait((operation, block_hash, payload))
        except queue.Full:
            logger.warning("KV disk tier: %d writes pending; skipping one %s", MAX_PENDING_DISK_WRITES, operation)

    def _write_loop(self) -> None:
        assert self._disk is not None
        while (item := self._write_queue.get()) is not None:
            operation, block_hash, payload = item
            try:
                if operation == "delete":
                    self._disk.delete(block_hash)
                else:
                    assert payload is not None
                    self._disk.write(block_hash, payload.numpy().tobytes())
                    self._count_saved(KVMedium.DISK, self.codec.block_bytes)
            except OSError as exc:  # a full or failing disk: the block is just not on disk
                logger.warning("KV disk tier: %s of block %s failed: %s", operation, block_hash.hex()[:16], exc)
            finally:
                self._write_queue.task_done()
        self._write_queue.task_done()  # the None that stopped the loop

    def _count_saved(self, medium: KVMedium, num_bytes: int) -> None:
        with self._results_lock:
            self._saved_bytes[medium] = self._saved_bytes.get(medium, 0) + num_bytes

    # -- loads -------------------------------------------------------------------------

    def _cancel(self, request_id: str) -> None:
        """Stop a load now: once this returns no further block of it is copied, and its result
        (the blocks copied so far) is out, even if the loader is stuck in a read (a hung disk)."""
        job = self._jobs.get(request_id)
        if job is None:
            return
        with self._busy_lock:  # the block being copied, if any, is finished; no further one starts
            job.cancelled = True
            self._report(job, "cancelled")
        if job.load.peer is not None and self._client is not None:
            self._client.cancel(request_id)  # its later callbacks find it reported and do nothing

    def _load_loop(self) -> None:
        while (job := self._load_queue.get()) is not None:
            failure = self._load(job)
            with self._busy_lock:
                self._report(job, failure)

    def _report(self, job: _LoadJob, failure: str | None) -> None:
        """Publish a job's result once (the caller holds _busy_lock)."""
        if job.reported:
            return
        job.reported = True
        load = job.load
        if load.block_ids and self.codec.tensors[0].device.type == "cuda":
            torch.cuda.synchronize()  # the copies so far have landed before the scheduler uses them
        result = KVLoadResult(
            request_id=load.request_id,
            num_blocks_loaded=job.num_loaded,
            num_bytes=job.num_loaded * self.codec.block_bytes,
            seconds=time.perf_counter() - job.started,
            media=tuple(load.media[: job.num_loaded]),
            failure=failure if job.num_loaded < len(load.block_ids) else None,
        )
        with self._results_lock:
            self._results.append(result)
            self._results_lock.notify_all()

    @torch.no_grad()
    def _load(self, job: _LoadJob) -> str | None:
        """Copy the job's blocks in order until one fails or it is cancelled; returns why it
        stopped short (None: it did not)."""
        load = job.load
        for block_id, block_hash, medium in zip(load.block_ids, load.block_hashes, load.media, strict=True):
            if job.cancelled:
                return "cancelled"
            try:
                payload = self._read(block_hash, medium)
            except FileNotFoundError:
                return "missing"
            except CorruptBlockFile as exc:
                return f"corrupt: {exc}"
            except Exception as exc:  # any read error makes the rest a miss, never a crash
                logger.warning("KV load of block %s failed", block_hash.hex()[:16], exc_info=exc)
                return type(exc).__name__
            with self._busy_lock:
                if job.cancelled:
                    return "cancelled"
                self.codec.unpack(payload, block_id)
                job.num_loaded += 1
        return None

    # -- pulls (disaggregation, consumer side) ---------------------------------------------

    def _start_pull(self, job: _LoadJob) -> None:
        load, peer = job.load, job.load.peer
        assert peer is not None
        if self._client is None:  # the scheduler orders pulls only on a consumer
            with self._busy_lock:
                self._report(job, "not a consumer")
            return
        # The scheduler cancels at its own deadline; this one only stops a pull it lost track of.
        deadline = time.monotonic() + self._pull_timeout_s + 1.0
        self._client.start(load.request_id, peer.address, peer.transfer_id, load.block_hashes, deadline)

    @torch.no_grad()
    def _on_pulled_block(self, request_id: str, index: int, payload: memoryview) -> None:
        """The client's I/O thread: block `index` of a pull arrived, verified. Blocks come in order."""
        job = self._jobs.get(request_id)
        if job is None:
            return
        with self._busy_lock:
            if job.reported or index != job.num_loaded:
                return
            self.codec.unpack(torch.frombuffer(payload, dtype=torch.uint8), job.load.block_ids[index])
            job.num_loaded += 1

    def _on_pull_end(self, request_id: str, failure: str | None) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            with self._busy_lock:
                self._report(job, failure)

    def _host_payload(self, block_hash: bytes) -> memoryview | None:
        """Producer: the host copy of a block, for the transfer server (None: not saved yet)."""
        with self._host_lock:
            payload = self._host.get(block_hash)
        return payload.numpy().data if payload is not None else None  # a memoryview that keeps the tensor alive

    def _read(self, block_hash: bytes, medium: KVMedium) -> torch.Tensor:
        # The host copy, when there is one, is nearer than the file the index may have named.
        with self._host_lock:
            payload = self._host.get(block_hash)
        if payload is not None:
            return payload
        if medium is KVMedium.HOST or self._disk is None:
            raise FileNotFoundError(block_hash.hex())
        data = self._disk.read(block_hash, self.codec.block_bytes)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
