"""The producer's KV transfer server: one ROUTER socket, one thread, many pulls at once.

The thread never blocks on one pull: each turn it reads every incoming message, then advances
every active pull as far as the store allows (a few blocks per pull per turn, round robin, so a
long pull does not starve a short one), heartbeats the ones that wait, and polls — the socket and
a self-pipe the registry's listener writes to when blocks are saved — until the next heartbeat is
due. A payload goes out zero-copy: pyzmq keeps the host store's buffer alive until it is sent.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import zlib
from dataclasses import dataclass

import msgspec
import zmq

from servelm.disagg.exports import ExportRegistry
from servelm.disagg.protocol import (
    PullCancel,
    PullFailure,
    PullRequest,
    Reply,
    ReplyStatus,
    Waker,
    check_address,
    client_decoder,
)
from servelm.zmq_contexts import non_lingering_context

logger = logging.getLogger(__name__)

BLOCKS_PER_TURN = 4  # blocks one pull may send per turn before the next pull's turn
# Per client connection: messages queued in ZMQ at most (~47 MB of 737 KB blocks); beyond, sends
# wait for the consumer to read (a slow consumer must not grow the producer's memory without bound).
SEND_HWM = 64
MIN_HEARTBEAT_S = 0.02  # a client asking for faster heartbeats gets these
MAX_HEARTBEAT_S = 1.0
RETRY_S = 0.01  # poll timeout while a send waits for room, or an unknown transfer for its announce


@dataclass
class _ServedPull:
    identity: bytes  # the ROUTER's name for the client connection
    request: PullRequest
    arrived: float  # time.monotonic()
    deadline: float
    next_index: int = 0
    last_sent: float = 0.0  # time.monotonic() of the last reply sent
    finished: bool = False  # its last block, or its failure, is queued (maybe still stalled)
    stalled: list[bytes | memoryview] | None = None  # a reply that found no room; sent first next turn


class KVTransferServer:
    """Serves the blocks of `registry`'s exports to pulls, from a thread started here.

    The socket is bound in the constructor (errors surface to the caller at start-up): tcp on
    `host`:`port` (0: any free port; `address` is what was bound), and ipc at `ipc_path` too when
    given (`ipc_address`; same-host consumers may use either). `corrupt_every` > 0 flips one byte
    of every Nth block sent, after its crc32 is taken (fault injection for tests).
    Called by the producer's engine at start-up and shutdown; `close` is safe twice.
    """

    def __init__(
        self,
        registry: ExportRegistry,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        ipc_path: str | None = None,
        corrupt_every: int = 0,
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if corrupt_every < 0:
            raise ValueError(f"corrupt_every must be >= 0, got {corrupt_every}")
        self._registry = registry
        self._corrupt_every = corrupt_every
        self._num_blocks_sent = 0
        self._context = non_lingering_context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        # A send to a client that is gone raises (EHOSTUNREACH) instead of vanishing silently,
        # and a full queue raises Again instead of dropping the block.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._socket.bind(f"tcp://{host}:{port or '*'}")
            self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self.ipc_address: str | None = None
            if ipc_path is not None:
                self.ipc_address = f"ipc://{ipc_path}"
                check_address(self.ipc_address)
                self._socket.bind(self.ipc_address)
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise OSError(f"KV transfer server cannot bind tcp://{host}:{port} / {ipc_path}: {exc}") from exc
        self._pulls: dict[tuple[bytes, int], _ServedPull] = {}
        self._waker = Waker()
        registry.add_listener(self._waker.wake)
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-transfer-server", daemon=True)
        self._thread.start()

    @property
    def num_active_pulls(self) -> int:
        return len(self._pulls)

    def close(self) -> None:
        """Stop the thread and close the socket (pulls in flight end: their consumers see the peer
        go). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._registry.remove_listener(self._waker.wake)
        self._stop.set()
        self._waker.wake()
        self._thread.join(timeout=10)
        self._socket.close()
        self._context.term()
        self._waker.close()

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        timeout_s = 0.0
        while not self._stop.is_set():
            poller.poll(math.ceil(timeout_s * 1000))
            self._waker.drain()  # before serving: a save notified from now on wakes the next poll
            self._receive()
            timeout_s = self._serve()

    def _receive(self) -> None:
        while True:
            try:
                identity, message = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                decoded = client_decoder.decode(message)
            except msgspec.DecodeError as exc:
                logger.warning("KV transfer server: undecodable message dropped: %s", exc)
                continue
            if isinstance(decoded, PullCancel):
                self._pulls.pop((identity, decoded.pull_id), None)
                continue
            now = time.monotonic()
            pull = _ServedPull(identity, decoded, arrived=now, deadline=now + decoded.timeout_s)
            pull.finished = not decoded.block_hashes  # nothing to send (clients never ask for nothing)
            self._pulls[(identity, decoded.pull_id)] = pull
            self._send(pull, [msgspec.msgpack.encode(Reply(decoded.pull_id, ReplyStatus.ACK))])

    def _serve(self) -> float:
        """Advance every pull; the seconds until the next thing to do (0: more to send now)."""
        next_due = MAX_HEARTBEAT_S
        for key, pull in list(self._pulls.items()):
            now = time.monotonic()
            if now >= pull.deadline:  # the consumer has given up on it by now
                del self._pulls[key]
                continue
            if pull.stalled is None or self._send(pull, pull.stalled):
                more = False if pull.finished else self._advance(pull)
            else:
                more = False
            if key not in self._pulls:  # the client is gone
                continue
            if pull.finished and pull.stalled is None:  # its last reply is out
                del self._pulls[key]
                continue
            heartbeat_s = min(max(pull.request.heartbeat_s, MIN_HEARTBEAT_S), MAX_HEARTBEAT_S)
            if pull.stalled is None and time.monotonic() - pull.last_sent >= heartbeat_s:
                self._send(pull, [msgspec.msgpack.encode(Reply(pull.request.pull_id, ReplyStatus.HEARTBEAT))])
            if more:
                next_due = 0.0
            elif pull.stalled is not None:
                next_due = min(next_due, RETRY_S)
            else:
                next_due = min(next_due, max(0.0, pull.last_sent + heartbeat_s - time.monotonic()))
                # A transfer not announced yet fails "unknown" once wait_s has passed: wake then.
                unknown_due = pull.arrived + self._registry.wait_s - time.monotonic()
                if unknown_due > 0:
                    next_due = min(next_due, unknown_due)
        return next_due

    def _advance(self, pull: _ServedPull) -> bool:
        """Queue up to BLOCKS_PER_TURN blocks of `pull` (or its failure); whether it could send
        more right away. Sets `finished` once its last block or its failure is queued."""
        hashes = pull.request.block_hashes
        for _ in range(BLOCKS_PER_TURN):
            found = self._registry.next_block(pull.request.transfer_id, hashes[pull.next_index], pull.arrived)
            if found is None:
                return False
            if isinstance(found, PullFailure):
                pull.finished = True
                failed = Reply(pull.request.pull_id, ReplyStatus.FAILED, failure=found)
                self._send(pull, [msgspec.msgpack.encode(failed)])
                return False
            index = pull.next_index
            pull.next_index += 1
            if pull.next_index == len(hashes):
                pull.finished = True
                self._registry.mark_served(pull.request.transfer_id)
            if not self._send(pull, self._block_frames(pull.request.pull_id, index, found)) or pull.finished:
                return False
        return True

    def _block_frames(self, pull_id: int, index: int, payload: memoryview) -> list[bytes | memoryview]:
        header = Reply(pull_id, ReplyStatus.BLOCK, index=index, crc32=zlib.crc32(payload), length=payload.nbytes)
        self._num_blocks_sent += 1
        if self._corrupt_every and self._num_blocks_sent % self._corrupt_every == 0:
            damaged = bytearray(payload)  # never write into the host store's own buffer
            damaged[len(damaged) // 2] ^= 0xFF
            payload = memoryview(damaged)
        return [msgspec.msgpack.encode(header), payload]

    def _send(self, pull: _ServedPull, frames: list[bytes | memoryview]) -> bool:
        """Send one reply to `pull`'s client without blocking: False when there is no room (kept as
        `stalled`, sent first next turn) or the client is gone (its pulls are dropped)."""
        try:
            self._socket.send_multipart([pull.identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pull.stalled = frames
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            for key in [key for key in self._pulls if key[0] == pull.identity]:
                del self._pulls[key]
            return False
        pull.stalled = None
        pull.last_sent = time.monotonic()
        return True
