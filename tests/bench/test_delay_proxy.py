"""The delay proxy against a real echo server on 127.0.0.1: it adds its delay in each direction,
keeps every byte in order under jitter and loss, and forwards real HTTP."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from servelm.bench.delay_proxy import DelayProxy, LinkFaults, parse_target


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(port: int, payload: bytes) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    await reader.readexactly(len(payload))
    elapsed = time.monotonic() - started
    writer.close()
    return elapsed


def test_delay_is_added_in_each_direction():
    async def main() -> tuple[float, float]:
        echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = echo.sockets[0].getsockname()[1]
        direct = await _round_trip(port, b"ping")
        async with DelayProxy("127.0.0.1", port, LinkFaults(delay_s=0.08)) as proxy:
            proxied = await _round_trip(proxy.port, b"ping")
        echo.close()
        return direct, proxied

    direct, proxied = asyncio.run(main())
    assert direct < 0.05
    assert 0.16 <= proxied < 0.4, f"two one-way delays of 80 ms, got {proxied:.3f} s"


def test_bytes_keep_their_order_under_jitter_and_loss():
    chunks = [os.urandom(size) for size in (1, 7, 1000, 65536, 3, 200_000, 17) * 4]

    async def main() -> tuple[bytes, int]:
        echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = echo.sockets[0].getsockname()[1]
        faults = LinkFaults(delay_s=0.001, jitter_s=0.02, loss=0.3, rto_s=0.01)
        async with DelayProxy("127.0.0.1", port, faults, seed=1) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            for chunk in chunks:  # separate writes: the proxy sees (and delays) many chunks
                writer.write(chunk)
                await writer.drain()
                await asyncio.sleep(0.002)
            writer.write_eof()
            received = await reader.read()  # to EOF: the proxy forwards the half-close both ways
            writer.close()
            connections = proxy.num_connections
        echo.close()
        return received, connections

    received, connections = asyncio.run(main())
    assert received == b"".join(chunks)
    assert connections == 1


def test_loss_costs_retransmission_timeouts():
    async def main() -> float:
        echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = echo.sockets[0].getsockname()[1]
        async with DelayProxy("127.0.0.1", port, LinkFaults(delay_s=0.0, loss=0.5, rto_s=0.05), seed=2) as proxy:
            total = sum([await _round_trip(proxy.port, b"x") for _ in range(20)])
        echo.close()
        return total

    total = asyncio.run(main())
    # 40 one-way trips, each lost with p=0.5 at 50 ms: ~1 s expected; 0 if loss did nothing.
    assert 0.4 < total < 2.0, total


def test_http_through_the_proxy(bench_server):
    host, port = parse_target(bench_server.base_url.removeprefix("http://"))

    async def main() -> tuple[httpx.Response, float]:
        async with DelayProxy(host, port, LinkFaults(delay_s=0.05)) as proxy:
            async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
                started = time.monotonic()
                response = await client.get("/v1/models")
                return response, time.monotonic() - started

    response, elapsed = asyncio.run(main())
    assert response.status_code == 200 and response.json()["data"]
    assert elapsed >= 0.1


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="loss"):
        LinkFaults(delay_s=0.1, loss=1.5)
    with pytest.raises(ValueError, match="delay_s"):
        LinkFaults(delay_s=-1)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_target("localhost")
