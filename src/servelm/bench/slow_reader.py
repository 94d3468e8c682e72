"""An httpx transport for clients that read their stream slowly (a phone on a weak link, a busy UI).

A slow reader only backs up the *server* once every buffer between them is full: the client's
receive window, the server's socket send buffer, then uvicorn's transport buffer (64 kB), and
only then does the server's SSE write block and engine outputs queue in the API process
(`servelm:num_outputs_queued_in_api`). On loopback the server's send buffer autotunes to
~3 MB because loopback's MSS is 64 kB (Linux sizes it from cwnd x MSS), far more than any
stream here. So the connection is made to look like a real link before it connects:

    SO_RCVBUF  4 kB     a small receive window
    TCP_MAXSEG 1448     Ethernet's MSS: the server's send buffer starts at ~90 kB, not ~3 MB

Both must be set before connect() (the window scale and MSS are fixed by the handshake),
and httpx/httpcore set socket options only after it, so connections are opened here. Then the
reader consumes at most `read_bytes` per `read_delay_s` (a token bucket holding a few reads'
worth): a response's headers and first chunks pass at once, as on any link, and the reader
falls behind only once a stream outpaces it (so its TTFT is not inflated: the fault is the
output path backing up, not a slow network).
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
import typing
from dataclasses import dataclass

import anyio
import anyio.abc
import httpcore
import httpx

from servelm.bench.workload import WorkloadRequest

SMALL_RECEIVE_BUFFER = 4096
ETHERNET_MSS = 1448
BURST_READS = 4  # the bucket holds this many reads' worth


@dataclass(frozen=True)
class SlowReading:
    read_delay_s: float  # consumes read_bytes per read_delay_s (0: as fast as it comes)
    read_bytes: int = 1024  # at most this much per read

    def __post_init__(self) -> None:
        if self.read_delay_s < 0:
            raise ValueError(f"read_delay_s must be >= 0, got {self.read_delay_s}")
        if self.read_bytes < 1:
            raise ValueError(f"read_bytes must be >= 1, got {self.read_bytes}")


class _SlowStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: anyio.abc.SocketStream, reading: SlowReading) -> None:
        self._stream = stream
        self._reading = reading
        self._burst = BURST_READS * reading.read_bytes
        self._bytes_allowed = float(self._burst)  # the bucket: bytes it may read now (< 0: behind)
        self._refilled = time.monotonic()

    def _refill(self) -> float:
        """Top up the bucket; returns the seconds until it allows a read (0: now)."""
        now = time.monotonic()
        if self._reading.read_delay_s == 0:
            return 0.0
        rate = self._reading.read_bytes / self._reading.read_delay_s  # bytes/s
        self._bytes_allowed = min(self._burst, self._bytes_allowed + (now - self._refilled) * rate)
        self._refilled = now
        return 0.0 if self._bytes_allowed > 0 else (1.0 - self._bytes_allowed) / rate

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        wait = self._refill()
        if wait > 0:
            await anyio.sleep(wait)
            self._refill()
        try:
            with anyio.fail_after(timeout):
                data = await self._stream.receive(min(max_bytes, self._reading.read_bytes))
        except anyio.EndOfStream:
            return b""
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise httpcore.ReadError(str(exc)) from exc
        self._bytes_allowed -= len(data)
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            with anyio.fail_after(timeout):
                await self._stream.send(buffer)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        await self._stream.aclose()

    def get_extra_info(self, info: str) -> typing.Any:
        return self._stream.extra(anyio.abc.SocketAttribute.raw_socket, None) if info == "socket" else None


class _SlowLinkBackend(httpcore.AsyncNetworkBackend):
    """TCP connections with a small window and Ethernet's MSS (set before connect), read slowly."""

    def __init__(self, reading: SlowReading) -> None:
        self.reading = reading

    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:  # fmt: skip
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RECEIVE_BUFFER)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, ETHERNET_MSS)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
            sock.setblocking(False)
            with anyio.fail_after(timeout):
                await asyncio.get_running_loop().sock_connect(sock, (host, port))
            stream = await anyio.abc.SocketStream.from_socket(sock)
        except TimeoutError as exc:
            sock.close()
            raise httpcore.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            sock.close()
            raise httpcore.ConnectError(str(exc)) from exc
        return _SlowStream(stream, self.reading)

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


def slow_reader_transport(reading: SlowReading, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose connections read as `reading` says (see module doc)."""
    transport = httpx.AsyncHTTPTransport(limits=limits)
    # httpx takes no network backend; its pool (httpcore.AsyncConnectionPool) does, and hands it
    # to every connection it opens. Checked, so an httpx that renames it fails loudly here.
    pool = transport._pool
    if not hasattr(pool, "_network_backend"):
        raise RuntimeError("this httpx/httpcore has no pool network backend to replace: slow readers need one")
    pool._network_backend = _SlowLinkBackend(reading)
    return transport


def mark_slow_readers(requests: list[WorkloadRequest], fraction: float, seed: int) -> list[WorkloadRequest]:
    """Mark `fraction` of the requests as slow readers, drawn per request from the seed (the same
    requests whatever else the run changes); returns the same list."""
    rng = random.Random(f"{seed}:slow-readers")
    for request in requests:
        request.slow_reader = rng.random() < fraction
    return requests
