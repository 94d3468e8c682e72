"""Finding free local ports for a cluster whose config numbers its ports consecutively."""

from __future__ import annotations

import random
import socket


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


def free_port_range(count: int, low: int = 20000, high: int = 60000, attempts: int = 200) -> int:
    """First port of `count` consecutive ports that are free right now (racy, like any such probe)."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(low, high - count)
        if ports_free(range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found in {low}..{high}")
