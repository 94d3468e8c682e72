"""A TCP proxy on 127.0.0.1 whose connections a test can cut (a reset on both sides), refuse, or
freeze (bytes stop flowing, the sockets stay open): a network fault between the router and one
replica, with the replica process untouched. Runs its own event loop in a daemon thread."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

_READ_SIZE = 65536


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dead host or a middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class CutProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.num_connections = 0  # accepted so far
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._refusing = False
        self._flowing = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._start)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def cut(self) -> None:
        """Reset every open connection, both sides."""
        self._call(self._cut_all)

    def refuse(self, refusing: bool) -> None:
        """While refusing, open connections are cut and new ones reset at once."""
        self._refusing = refusing
        if refusing:
            self.cut()

    def freeze(self, frozen: bool) -> None:
        """While frozen no byte moves either way; the connections stay open."""
        self._loop.call_soon_threadsafe(self._flowing.clear if frozen else self._flowing.set)

    def close(self) -> None:
        self._call(self._stop)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _call(self, make: Callable[[], Any]) -> Any:
        async def run() -> Any:
            result = make()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    async def _start(self) -> None:
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def _stop(self) -> None:
        self._cut_all()
        if self._server is not None:
            self._server.close()

    def _cut_all(self) -> None:
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        if self._refusing:
            _reset(client_writer)
            return
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            _reset(client_writer)
            return
        self._writers.update((client_writer, server_writer))
        pumps = [asyncio.ensure_future(self._pump(client_reader, server_writer)),
                 asyncio.ensure_future(self._pump(server_reader, client_writer))]  # fmt: skip
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        for writer in (client_writer, server_writer):
            self._writers.discard(writer)
            writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(_READ_SIZE):
                await self._flowing.wait()
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
