"""The KV transfer's wire protocol (msgspec msgpack) and the reasons a pull fails.

    consumer (DEALER)                                     producer (ROUTER)
    [PullRequest] ───────────────────────────────────────▶ ack at once, even for a transfer it
                  ◀─────────────────────────────── [Reply ACK]   has not seen announced yet
                  ◀──────────── [Reply BLOCK index crc32 length, payload]   block by block, in order
                  ◀─────────────────────── [Reply HEARTBEAT]   while the next block is not computed
                  ◀──────────────────── [Reply FAILED failure]   unknown | expired | missing
    [PullCancel] ────────────────────────────────────────▶ stop serving it (consumer gave up)

The consumer knows how many blocks it asked for, so the last BLOCK ends a pull: there is no DONE.
Pulls are named by a `pull_id` unique per client; the ROUTER tells clients apart by identity.
"""

from __future__ import annotations

import enum
import os
import threading

import msgspec


class PullFailure(str, enum.Enum):
    """Why a pull ended before every block arrived (KVTransferClient's on_end). Blocks delivered
    before the failure stay valid in every case."""

    UNREACHABLE = "unreachable"  # the producer did not acknowledge the pull within wait_s
    UNKNOWN = "unknown"  # the producer never heard of the transfer (not announced within wait_s)
    EXPIRED = "expired"  # the producer dropped the transfer (not pulled within its hold time)
    MISSING = "missing"  # a block will never be there (the prefill ended, or evicted it)
    CORRUPT = "corrupt"  # a block's length or crc32 did not match its header: not delivered
    TIMEOUT = "timeout"  # the pull's deadline passed
    CANCELLED = "cancelled"  # the consumer cancelled it
    PEER_GONE = "peer_gone"  # no block or heartbeat for wait_s after the acknowledgement


class ReplyStatus(str, enum.Enum):
    ACK = "ack"  # the pull is registered; heartbeats follow while it waits
    BLOCK = "block"  # a payload frame follows the header
    HEARTBEAT = "heartbeat"  # still alive; the next block is not computed yet
    FAILED = "failed"  # `failure` says why; nothing more follows for this pull


class PullRequest(msgspec.Struct, frozen=True, tag="pull"):
    pull_id: int
    transfer_id: str
    block_hashes: list[bytes]  # the blocks wanted, in order (a prompt's full blocks, or a tail of them)
    # Seconds the consumer waits at most (its deadline, relative: the hosts' clocks differ); the
    # producer stops serving the pull after it.
    timeout_s: float
    heartbeat_s: float  # the longest gap the producer should leave between two replies


class PullCancel(msgspec.Struct, frozen=True, tag="cancel"):
    pull_id: int


ClientMessage = PullRequest | PullCancel


class Reply(msgspec.Struct, frozen=True):
    """The header frame of every producer → consumer message."""

    pull_id: int
    status: ReplyStatus
    index: int = -1  # BLOCK: position of the block in the pull's block_hashes
    crc32: int = 0  # BLOCK: zlib.crc32 of the payload as the producer has it
    length: int = 0  # BLOCK: bytes in the payload frame
    failure: PullFailure | None = None  # FAILED: why


client_encoder = msgspec.msgpack.Encoder()
client_decoder: msgspec.msgpack.Decoder[ClientMessage] = msgspec.msgpack.Decoder(ClientMessage)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def check_address(address: str) -> None:
    """Raise ValueError unless `address` is a ZMQ endpoint this transport speaks (tcp:// or ipc://)."""
    if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
        raise ValueError(f"KV transfer address must be tcp://HOST:PORT or ipc://PATH, got {address!r}")


class Waker:
    """A self-pipe a ZMQ poller can watch: another thread calls `wake()` to end the I/O thread's
    poll at once (ZMQ sockets are not thread-safe, so other threads never touch them). A wake
    after `close` does nothing (it must never write into a reused descriptor)."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"\0")
            except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
                pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.fd)
            os.close(self._write_fd)
