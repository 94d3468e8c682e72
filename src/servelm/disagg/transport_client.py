"""The consumer's KV transfer client: many pulls at once over one I/O thread.

One request's pull may wait seconds for its prefill while another's streams, so pulls never wait
for each other: `start` returns at once, and the I/O thread (the only one that touches the ZMQ
sockets: one DEALER per producer, created by `connect` at start-up or on first use) sends the
requests, verifies and delivers each block as it arrives, and ends pulls on their timers:

    start ──▶ request sent ──ack──▶ blocks / heartbeats ... ──last block──▶ on_end(key, None)
                │                       │
                └ no reply in wait_s:   └ silent for wait_s: "peer_gone"; deadline: "timeout";
                  "unreachable"           bad length/crc32: "corrupt"; the producer's "unknown",
                                          "expired", "missing"; cancel(): "cancelled"

ZMQ reconnects silently forever, so liveness is the protocol's: an acknowledgement, then a block
or a heartbeat at least every wait_s/4, or the pull fails. The DEALERs queue messages only on live
connections (IMMEDIATE), so a pull given up on is never delivered to a producer that comes back.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from servelm.disagg.protocol import (
    PullCancel,
    PullFailure,
    PullRequest,
    Reply,
    ReplyStatus,
    Waker,
    check_address,
    client_encoder,
    reply_decoder,
)
from servelm.zmq_contexts import non_lingering_context

logger = logging.getLogger(__name__)

RECV_HWM = 64  # per producer: blocks queued in ZMQ at most; beyond, TCP pushes back on the producer
RETRY_S = 0.01  # resend a request that found no live connection after this long
MAX_POLL_S = 0.1
# Failures the producer reported: it has already forgotten the pull, so no PullCancel is sent.
_PRODUCER_FAILURES = (PullFailure.UNKNOWN, PullFailure.EXPIRED, PullFailure.MISSING)


@dataclass(eq=False)
class _Pull:
    key: str
    address: str
    request: PullRequest
    deadline: float  # time.monotonic()
    started: float  # time.monotonic() of start(): the producer must answer within wait_s of it
    sent: bool = False  # the request is queued on a live connection
    last_heard: float | None = None  # time.monotonic() of the producer's last reply; None: none yet
    next_index: int = 0  # the block expected next


class KVTransferClient:
    """Pulls blocks of `block_bytes` bytes from producers' KVTransferServers.

    Callbacks run on the I/O thread, except that `cancel` and `close` deliver the "cancelled"
    `on_end` on their caller's thread; they run under the client's lock, so they may call `start`
    and `cancel` themselves, and must not wait on a thread that is calling `cancel`:
    - on_block(key, index, payload): block `index` of pull `key` arrived whole (its length and
      crc32 checked); `payload` is read-only and the caller copies it out;
    - on_end(key, failure): the pull ended: None when every block arrived, else a PullFailure
      (a str). Exactly once per `start`; blocks delivered before a failure stay valid.
    Called by the consumer's engine from any thread; `close` is safe twice.
    """

    def __init__(
        self,
        block_bytes: int,
        wait_s: float,
        on_block: Callable[[str, int, memoryview], None],
        on_end: Callable[[str, str | None], None],
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if wait_s <= 0:
            raise ValueError(f"wait_s must be positive, got {wait_s}")
        self.block_bytes = block_bytes
        self.wait_s = wait_s
        self._on_block = on_block
        self._on_end = on_end
        self._lock = threading.RLock()  # guards the pulls; held while a callback runs
        self._pulls: dict[str, _Pull] = {}
        self._by_id: dict[int, _Pull] = {}
        self._pull_ids = itertools.count()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._context = non_lingering_context()
        self._sockets: dict[str, zmq.Socket[bytes]] = {}  # address → DEALER; the I/O thread's only
        self._poller = zmq.Poller()
        self._waker = Waker()
        self._poller.register(self._waker.fd, zmq.POLLIN)
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-transfer-client", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------

    def connect(self, address: str) -> None:
        """Open the connection to the producer at `address` now (at start-up), not on first pull.
        Returns at once; safe to repeat."""
        check_address(address)
        self._command(lambda: self._open(address))

    def start(
        self, key: str, address: str, transfer_id: str, block_hashes: Sequence[bytes], deadline_monotonic: float
    ) -> None:
        """Pull blocks `block_hashes` of `transfer_id` from the producer at `address`, for the
        consumer's request `key` (one pull per key at a time), until time.monotonic() reaches
        `deadline_monotonic`. Returns at once; on_block / on_end report the progress."""
        check_address(address)
        if not block_hashes:
            raise ValueError(f"pull {key!r}: no block hashes to pull")
        if not transfer_id:
            raise ValueError(f"pull {key!r}: transfer_id must be a non-empty string")
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError("KVTransferClient is closed")
            if key in self._pulls:
                raise ValueError(f"a pull for {key!r} is already running")
            request = PullRequest(
                pull_id=next(self._pull_ids),
                transfer_id=transfer_id,
                block_hashes=list(block_hashes),
                timeout_s=max(0.0, deadline_monotonic - now),
                heartbeat_s=self.wait_s / 4,
            )
            pull = _Pull(key, address, request, deadline=deadline_monotonic, started=now)
            self._pulls[key] = pull
            self._by_id[request.pull_id] = pull
        self._command(lambda: self._send_request(pull))

    def cancel(self, key: str) -> None:
        """Stop pull `key`: once this returns, no on_block for it runs any more. Its on_end(key,
        "cancelled") is delivered (on this thread) unless it had already ended. Safe to repeat."""
        with self._lock:
            pull = self._pulls.get(key)
            if pull is None:
                return
            self._end(pull, PullFailure.CANCELLED)

    def close(self) -> None:
        """Cancel every pull, stop the I/O thread, close the connections. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for pull in list(self._pulls.values()):
                self._end(pull, PullFailure.CANCELLED)
        self._stop.set()
        self._waker.wake()
        self._thread.join(timeout=10)
        self._context.term()
        self._waker.close()

    def _command(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._waker.wake()

    def _end(self, pull: _Pull, failure: PullFailure | None) -> None:
        """End `pull` (the lock held): on_end once; tell the producer to stop if it still serves it."""
        if self._pulls.get(pull.key) is not pull:
            return
        del self._pulls[pull.key]
        del self._by_id[pull.request.pull_id]
        if failure is not None and pull.sent and failure not in _PRODUCER_FAILURES:
            cancel = client_encoder.encode(PullCancel(pull.request.pull_id))
            self._command(lambda: self._send_cancel(pull.address, cancel))
        self._on_end(pull.key, failure)

    # -- the I/O thread -------------------------------------------------------------------------

    def _run(self) -> None:
        timeout_s = 0.0
        while not self._stop.is_set():
            for socket, _ in self._poller.poll(math.ceil(timeout_s * 1000)):
                if isinstance(socket, zmq.Socket):
                    self._receive(socket)
            self._waker.drain()
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            timeout_s = self._check_timers()
        for socket in self._sockets.values():
            socket.close(linger=0)

    def _open(self, address: str) -> None:
        self._socket_for(address)

    def _socket_for(self, address: str) -> zmq.Socket[bytes] | None:
        """The DEALER connected to `address`; None (logged) when ZMQ refuses the address."""
        socket = self._sockets.get(address)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)
            socket.setsockopt(zmq.RCVHWM, RECV_HWM)
            try:
                socket.connect(address)
            except zmq.ZMQError as exc:
                logger.warning("KV transfer client: cannot connect to %s: %s", address, exc)
                socket.close()
                return None
            self._poller.register(socket, zmq.POLLIN)
            self._sockets[address] = socket
        return socket

    def _send_request(self, pull: _Pull) -> None:
        # Under the lock, so that a concurrent cancel sees `sent` as it is and cancels at the producer.
        with self._lock:
            if self._pulls.get(pull.key) is not pull or pull.sent:
                return  # ended before its request went out, or sent by a retry already
            socket = self._socket_for(pull.address)
            if socket is None:
                self._end(pull, PullFailure.UNREACHABLE)
                return
            try:
                socket.send(client_encoder.encode(pull.request), zmq.NOBLOCK)
                pull.sent = True
            except zmq.Again:  # no live connection yet: retried by the timers until wait_s has passed
                pass

    def _send_cancel(self, address: str, message: bytes) -> None:
        socket = self._socket_for(address)
        try:
            if socket is not None:
                socket.send(message, zmq.NOBLOCK)
        except zmq.Again:  # the producer is unreachable: it is not serving the pull either
            pass

    def _receive(self, socket: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = reply_decoder.decode(frames[0].buffer)
            except msgspec.DecodeError as exc:
                logger.warning("KV transfer client: undecodable reply dropped: %s", exc)
                continue
            with self._lock:
                pull = self._by_id.get(reply.pull_id)
                if pull is None:
                    continue  # a pull that ended already
                pull.last_heard = time.monotonic()
                if reply.status is ReplyStatus.FAILED:
                    self._end(pull, reply.failure or PullFailure.MISSING)
                elif reply.status is ReplyStatus.BLOCK:
                    self._deliver(pull, reply, frames[1].buffer if len(frames) == 2 else None)

    def _deliver(self, pull: _Pull, reply: Reply, payload: memoryview | None) -> None:
        """Verify and hand one block to on_block (the lock held)."""
        whole = (
            payload is not None
            and reply.index == pull.next_index
            and reply.length == payload.nbytes == self.block_bytes
            and zlib.crc32(payload) == reply.crc32
        )
        if not whole:
            logger.warning(
                "KV transfer: block %d of pull %s failed verification (index %d expected, %s of %d bytes)",
                reply.index, pull.key, pull.next_index, None if payload is None else payload.nbytes, reply.length,
            )  # fmt: skip
            self._end(pull, PullFailure.CORRUPT)
            return
        assert payload is not None
        self._on_block(pull.key, reply.index, payload)
        if self._pulls.get(pull.key) is not pull:
            return  # on_block cancelled it
        pull.next_index += 1
        if pull.next_index == len(pull.request.block_hashes):
            self._end(pull, None)

    def _check_timers(self) -> float:
        """End the pulls whose time is up; resend requests still unsent. Seconds to the next due."""
        now = time.monotonic()
        next_due = MAX_POLL_S
        with self._lock:
            for pull in list(self._pulls.values()):
                heard = pull.started if pull.last_heard is None else pull.last_heard
                if now >= pull.deadline:
                    self._end(pull, PullFailure.TIMEOUT)
                elif now - heard >= self.wait_s:
                    self._end(pull, PullFailure.UNREACHABLE if pull.last_heard is None else PullFailure.PEER_GONE)
                else:
                    if not pull.sent:
                        self._send_request(pull)
                        next_due = min(next_due, RETRY_S)
                    next_due = min(next_due, pull.deadline - now, heard + self.wait_s - now)
        return max(0.0, next_due)
