"""Clients that misbehave on purpose, and processes' memory, for the overload tests and benchmarks.

    stalled = StalledStream.open(port, "/v1/completions", HEAVY_STREAM)   # sends, then never reads
    ...                                                                  # the server's writes back up
    stalled.drain_to_eof(timeout_s=30)                                   # what it got, once cut

A StalledStream is a raw socket with a small receive buffer (set before connecting, so the
window the server sees stays small), bound to `source` when given: any 127.x.y.z address
is this machine's, so one test can be several clients by address.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# A stream that fills the socket buffers between two processes on loopback (Linux caps a send
# buffer at 4 MB) with its first event, on any machine however slow: each of its 16 choices
# echoes the 900-token prompt with 20 logprobs per token (~7 MB together), then 100 engine steps
# add 16 outputs each (the backlog a stalled client leaves behind). Fits a 1024-token context.
HEAVY_STREAM: dict[str, Any] = {"prompt": list(range(1000, 1900)), "max_tokens": 100, "ignore_eos": True, "n": 16,
                                "echo": True, "logprobs": 20, "stream": True}  # fmt: skip


@dataclass
class StalledStream:
    sock: socket.socket

    @classmethod
    def open(
        cls, port: int, path: str, body: dict[str, Any], source: str | None = None, host: str = "127.0.0.1",
        headers: dict[str, str] | None = None,
    ) -> StalledStream:  # fmt: skip
        payload = json.dumps(body).encode()
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        request = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
                   f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload  # fmt: skip
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: before connect
        if source is not None:
            sock.bind((source, 0))
        sock.connect((host, port))
        sock.sendall(request)
        return cls(sock)

    def read_head(self, timeout_s: float = 30.0) -> bytes:
        """The response's status line and headers (reads a little, so the stream has surely started)."""
        self.sock.settimeout(timeout_s)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(1024)
            if not chunk:
                break
            data += chunk
        return data.split(b"\r\n\r\n", 1)[0]

    def drain_to_eof(self, timeout_s: float) -> tuple[bytes, bool]:
        """Read everything until the server closes; (the last 64 kB read, whether it closed in time)."""
        deadline = time.monotonic() + timeout_s
        tail = b""
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            except ConnectionResetError:
                return tail, True
            if not chunk:
                return tail, True
            tail = (tail + chunk)[-(1 << 16):]
        return tail, False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> StalledStream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def rss_bytes(pid: int) -> int:
    """The resident set size of process `pid` (Linux /proc), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class RssSampler:
    """The RSS of named processes, sampled every `interval_s` on a thread while in its `with`:
    `before` (on entry), `peak` and `after` (on exit), in bytes per name."""

    pids: Mapping[str, int]
    interval_s: float = 0.1
    before: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _sample(self) -> dict[str, int]:
        return {name: rss_bytes(pid) for name, pid in self.pids.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name, value in self._sample().items():
                self.peak[name] = max(self.peak.get(name, 0), value)

    def __enter__(self) -> RssSampler:
        self.before = self._sample()
        self.peak = dict(self.before)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.after = self._sample()
        for name, value in self.after.items():
            self.peak[name] = max(self.peak.get(name, 0), value)

    def growth_mb(self) -> dict[str, float]:
        """Peak above `before`, per name, in MB."""
        return {name: (self.peak[name] - self.before[name]) / 2**20 for name in self.pids}

    def report(self) -> str:
        return ", ".join(f"{name}: {self.before[name] / 2**20:.0f} -> peak {self.peak[name] / 2**20:.0f} -> "
                         f"{self.after.get(name, 0) / 2**20:.0f} MB" for name in self.pids)  # fmt: skip
