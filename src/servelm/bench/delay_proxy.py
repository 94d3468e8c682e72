"""A TCP proxy on 127.0.0.1 that adds network latency: one-way delay, jitter and loss, per direction.

    client ──▶ [listen] ─ upstream pump: read chunk, due = now + delay (+ jitter, + RTO if "lost") ─▶ server
    client ◀── ─────────── downstream pump: the same, the other way ◀────────────────────────────── server

Each direction is a reader and a writer joined by a queue of (due time, chunk): the reader never
waits for the delay, so latency is added without cutting throughput (a link with a long RTT,
not a slow one). Bytes keep their order: a chunk's due time is never earlier than the one before
it, so jitter and loss delay later chunks too (TCP's in-order delivery: head-of-line blocking),
but never reorder them.

Loss is modelled as TCP shows it to an application: the bytes are not lost, they arrive one
retransmission timeout late. A chunk is "lost" with probability `loss` and gets `rto_s` extra.

Used by the `network-delay` scenario (between the bench client and the server) and by hand:
`servelm bench proxy --target 127.0.0.1:8000 --listen-port 8001 --delay-ms 50`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_READ_SIZE = 65536
_EOF = b""  # queued after the last chunk: the writer half-closes its side when it comes due


@dataclass(frozen=True)
class LinkFaults:
    """What the proxy adds to every chunk, in each direction separately."""

    delay_s: float  # one-way delay
    jitter_s: float = 0.0  # + uniform [0, jitter_s) per chunk
    loss: float = 0.0  # probability that a chunk needs one retransmission
    rto_s: float = 0.2  # what a retransmission costs (Linux's minimum RTO is 200 ms)

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s", "rto_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"LinkFaults.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"LinkFaults.loss must be in [0, 1), got {self.loss}")

    def describe(self) -> str:
        return (f"one-way delay {self.delay_s * 1000:g} ms + jitter up to {self.jitter_s * 1000:g} ms, "
                f"loss {self.loss:g} (+{self.rto_s * 1000:g} ms RTO each)")  # fmt: skip


@dataclass
class _Direction:
    """One direction of one connection: the reader stamps due times, the writer honours them."""

    faults: LinkFaults
    rng: random.Random
    queue: asyncio.Queue[tuple[float, bytes]] = field(default_factory=asyncio.Queue)
    last_due: float = 0.0

    def due(self) -> float:
        extra = self.rng.uniform(0.0, self.faults.jitter_s) if self.faults.jitter_s else 0.0
        if self.faults.loss and self.rng.random() < self.faults.loss:
            extra += self.faults.rto_s
        # Never before the previous chunk: order within a connection is preserved.
        self.last_due = max(time.monotonic() + self.faults.delay_s + extra, self.last_due)
        return self.last_due

    async def read(self, source: asyncio.StreamReader) -> None:
        try:
            while chunk := await source.read(_READ_SIZE):
                self.queue.put_nowait((self.due(), chunk))
        except ConnectionError:
            pass
        self.queue.put_nowait((self.due(), _EOF))

    async def write(self, sink: asyncio.StreamWriter) -> None:
        while True:
            due, chunk = await self.queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:  # _EOF
                if sink.can_write_eof():
                    with contextlib.suppress(OSError):
                        sink.write_eof()
                return
            sink.write(chunk)
            await sink.drain()


class DelayProxy:
    """Listens on 127.0.0.1 and forwards every connection to `target_host:target_port` with `faults`.

    Async context manager: entering starts listening (on `listen_port`, 0 = any free port; `url`
    says where), leaving closes the listener and every connection. Runs in the caller's event
    loop (`servelm.bench.scenario_run` runs the bench in a worker thread next to it). One
    seeded random stream per proxy, so a run's jitter and losses repeat with the seed.
    """

    def __init__(self, target_host: str, target_port: int, faults: LinkFaults, listen_port: int = 0,
                 seed: int = 0) -> None:  # fmt: skip
        if not 0 <= listen_port < 65536 or not 0 < target_port < 65536:
            raise ValueError(f"ports must be in 0..65535, got listen {listen_port}, target {target_port}")
        self.target = (target_host, target_port)
        self.faults = faults
        self.listen_port = listen_port
        self._rng = random.Random(f"delay-proxy:{seed}")
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self.num_connections = 0  # accepted so far

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not listening (use it as `async with DelayProxy(...)`)")
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.listen_port)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self.num_connections += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            logger.warning("delay proxy: cannot reach %s:%d: %s", *self.target, exc)
            client_writer.close()
            self._connections.discard(task)
            return
        up = _Direction(self.faults, self._rng)
        down = _Direction(self.faults, self._rng)
        pumps = [asyncio.create_task(pump) for pump in (up.read(client_reader), up.write(server_writer),
                                                          down.read(server_reader), down.write(client_writer))]  # fmt: skip
        try:
            # Both directions end (EOF each way), or one side breaks: then the rest go too.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            # The proxy is closing (__aexit__ cancels open connections). Returning instead of
            # re-raising: asyncio's stream server would log a cancelled handler as an error.
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for writer in (client_writer, server_writer):
                writer.close()
            self._connections.discard(task)


def parse_target(spec: str) -> tuple[str, int]:
    """`HOST:PORT` → (host, port)."""
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--target wants HOST:PORT, got {spec!r}")
    return host, int(port)


async def serve_forever(target: str, listen_port: int, faults: LinkFaults, seed: int = 0) -> None:
    """`servelm bench proxy`: run until cancelled (Ctrl-C)."""
    host, port = parse_target(target)
    async with DelayProxy(host, port, faults, listen_port, seed) as proxy:
        print(f"delay proxy {proxy.url} -> {host}:{port}: {faults.describe()}", flush=True)
        await asyncio.Event().wait()

