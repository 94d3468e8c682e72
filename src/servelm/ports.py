"""Free local ports for servers this process is about to start (a cluster's replicas, a test's
server, a process group's rendezvous), picked outside the kernel's ephemeral range.

A port found free by binding port 0 is an ephemeral one: between the probe closing it and the
server binding it, any process's outgoing connection may be given it, and the server then fails
with "address already in use" (seen with two test workers, one opening hundreds of client
connections). Ports below (or above) net.ipv4.ip_local_port_range are never handed to outgoing
connections, so only another deliberate pick can take them; picks are random over that room,
so two pickers rarely meet. Still racy, like any probe: it makes the race rare, not impossible.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default; elsewhere the file is missing
# Below this: well-known and registered services, and Ray's default worker ports (10002-19999),
# which a Ray cluster servelm starts or joins hands to its workers (a GCS port picked there failed).
LOWEST = 20000
MIN_ROOM = 2000  # ports a side of the ephemeral range must offer to be used


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def pick_range() -> tuple[int, int]:
    """[low, high) to pick server ports from: below the ephemeral range, else above it, else all."""
    ephemeral_low, ephemeral_high = ephemeral_range()
    if ephemeral_low - LOWEST >= MIN_ROOM:
        return LOWEST, ephemeral_low
    if 65536 - (ephemeral_high + 1) >= MIN_ROOM:
        return ephemeral_high + 1, 65536
    return LOWEST, 65536


def ports_free(ports: range) -> bool:
    sockets = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for sock in sockets:
            sock.close()


def free_port_range(count: int, attempts: int = 200) -> int:
    """First port of `count` consecutive ports that are free right now, outside the ephemeral range."""
    low, high = pick_range()
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(low, high - count)
        if ports_free(range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found in {low}..{high}")


def free_port() -> int:
    return free_port_range(1)
