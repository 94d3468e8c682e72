"""A small HTTP file server with Range support: the origin in tests and benchmarks, and the
server each node of a distribution runs to hand peers the chunks it holds.

    GET|HEAD /PATH              the file (200), or `Range: bytes=A-B` of it (206, Content-Range)
    GET /servelm-manifest.json  the manifest being served (from memory for a node mid-pull)
    GET /_servelm/stats         {"bytes_sent": N, "requests": [[path, start, end], ...]} (benchmarks, tests):
                                every body byte written, and the ranges whose bodies were written to the end
    GET /_servelm/<name>?k=v    extra JSON routes a caller adds (a node's held chunks), given the query

What is served comes from a `ServedFiles` (a directory; a node's ChunkStore). A byte range
that is not available yet answers 409 (a peer asks again later, or elsewhere). `rate_bytes_per_s`
caps the whole server's egress (one token bucket over every connection), as an origin's link
or egress quota would; `faults` injects corrupted or truncated responses for the fault tests.
Standard library only (ThreadingHTTPServer): a thread per connection is plenty for the tens of
connections a pull opens, and it runs in any process, the benchmark's origin included.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from servelm.delivery.manifest import MANIFEST_NAME, resolve_model_file

STATS_PATH = "/_servelm/stats"
EXTRA_PREFIX = "/_servelm/"
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
_SEND_PIECE = 256 << 10  # bytes written per throttle check


class ServedFiles(Protocol):
    def manifest_json(self) -> bytes | None: ...

    def size(self, path: str) -> int | None:
        """The file's size, None if there is no such file."""
        ...

    def available(self, path: str, start: int, end: int) -> bool:
        """Whether bytes start..end (exclusive) may be served now."""
        ...

    def open(self, path: str) -> BinaryIO: ...


@dataclass
class DirectoryFiles:
    """Every file under `root` (a model directory), its manifest file included if it has one."""

    root: Path

    def manifest_json(self) -> bytes | None:
        path = self.root / MANIFEST_NAME
        return path.read_bytes() if path.is_file() else None

    def size(self, path: str) -> int | None:
        resolved = resolve_model_file(self.root, path)
        return None if resolved is None else resolved.stat().st_size

    def available(self, path: str, start: int, end: int) -> bool:
        return True

    def open(self, path: str) -> BinaryIO:
        resolved = resolve_model_file(self.root, path)
        if resolved is None:
            raise FileNotFoundError(path)
        return resolved.open("rb")


@dataclass
class Faults:
    """Responses to spoil, each once: ranges starting at these (path, offset) pairs."""

    corrupt: set[tuple[str, int]] = field(default_factory=set)  # one byte flipped
    truncate: set[tuple[str, int]] = field(default_factory=set)  # half the body, then the connection closes

    def take(self, kind: set[tuple[str, int]], path: str, start: int) -> bool:
        if (path, start) in kind:
            kind.discard((path, start))
            return True
        return False


class TokenBucket:
    """`rate` bytes per second over all callers, with a burst of a tenth of a second."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = rate / 10
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, amount: int) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self.rate / 10, self._tokens + (now - self._stamp) * self.rate)
                self._stamp = now
                if self._tokens >= amount or self._tokens >= self.rate / 10:
                    self._tokens -= amount
                    return
                wait = (amount - self._tokens) / self.rate
            time.sleep(min(wait, 0.05))


# An extra JSON route: called with the request's query parameters (the last value of each).
ExtraRoute = Callable[[dict[str, str]], object]


class RangeFileServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        files: ServedFiles,
        host: str = "127.0.0.1",
        port: int = 0,
        rate_bytes_per_s: float | None = None,
        faults: Faults | None = None,
        extra_routes: dict[str, ExtraRoute] | None = None,
    ) -> None:
        super().__init__((host, port), _Handler)
        self._host = host
        self.files = files
        self.bucket = TokenBucket(rate_bytes_per_s) if rate_bytes_per_s else None
        self.faults = faults or Faults()
        self.extra_routes = extra_routes or {}
        self.stats_lock = threading.Lock()
        self.bytes_sent = 0
        self.requests: list[tuple[str, int, int]] = []  # (path, start, end) of every body written to its end
        # Bodies being written: a client may hold a body's last byte before its writer logs it.
        self._bodies_in_flight = 0
        self._bodies_done = threading.Condition(self.stats_lock)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.server_port}/"

    def start(self) -> RangeFileServer:
        """Serve from a daemon thread; returns self."""
        # A short poll: stop() waits up to one poll interval (0.5 s by default, per server in every test).
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), name="range-file-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def wait_for_bodies(self, timeout_s: float = 10.0) -> bool:
        """Wait until no body is being written, so `requests` lists every one a client received
        whole (its entry is appended after the last byte went out). False on timeout."""
        with self._bodies_done:
            return self._bodies_done.wait_for(lambda: self._bodies_in_flight == 0, timeout_s)

    def body_started(self) -> None:
        with self.stats_lock:
            self._bodies_in_flight += 1

    def body_ended(self, logged: tuple[str, int, int] | None) -> None:
        with self._bodies_done:
            if logged is not None:
                self.requests.append(logged)
            self._bodies_in_flight -= 1
            self._bodies_done.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that hung up mid-body (a killed node, a cut pull): its business, not a traceback
        super().handle_error(request, client_address)

    def stats(self) -> dict[str, object]:
        with self.stats_lock:
            return {"bytes_sent": self.bytes_sent, "requests": [list(r) for r in self.requests]}


class _Handler(BaseHTTPRequestHandler):
    server: RangeFileServer
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle on, the body's first small write
    # waits for the client's delayed ACK of the headers, ~40 ms on every request.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per chunk would drown the logs

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _json(self, value: object, body: bool) -> None:
        payload = json.dumps(value).encode()
        self._send_bytes(HTTPStatus.OK, payload, "application/json", body)

    def _send_bytes(self, status: HTTPStatus, payload: bytes, content_type: str, body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def _error(self, status: HTTPStatus, message: str, body: bool) -> None:
        self._send_bytes(status, json.dumps({"error": message}).encode(), "application/json", body)

    def _serve(self, body: bool) -> None:
        path = urllib.parse.unquote(self.path.split("?", 1)[0])  # clients quote spaces, '#', '?' in names
        if path == STATS_PATH:
            return self._json(self.server.stats(), body)
        if path.startswith(EXTRA_PREFIX) and path[len(EXTRA_PREFIX):] in self.server.extra_routes:
            query = dict(urllib.parse.parse_qsl(self.path.partition("?")[2]))
            return self._json(self.server.extra_routes[path[len(EXTRA_PREFIX):]](query), body)
        relative = path.lstrip("/")
        if relative == MANIFEST_NAME:
            manifest = self.server.files.manifest_json()
            if manifest is None:
                return self._error(HTTPStatus.NOT_FOUND, "no manifest here", body)
            return self._send_bytes(HTTPStatus.OK, manifest, "application/json", body)
        size = self.server.files.size(relative)
        if size is None:
            return self._error(HTTPStatus.NOT_FOUND, f"no file {relative!r}", body)
        start, end, status = 0, size, HTTPStatus.OK
        header = self.headers.get("Range")
        if header:
            match = _RANGE.match(header.strip())
            if match is None or not any(match.groups()):
                return self._error(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, f"bad Range {header!r}", body)
            first, last = match.groups()
            if first:
                start, end = int(first), min(size, int(last) + 1) if last else size
            else:  # a suffix range: the last N bytes
                start, end = max(0, size - int(last)), size
            if start >= size or end <= start:
                return self._error(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, f"Range {header!r} of {size} bytes", body)
            status = HTTPStatus.PARTIAL_CONTENT
        if not self.server.files.available(relative, start, end):
            return self._error(HTTPStatus.CONFLICT, f"bytes {start}-{end - 1} of {relative!r} are not held yet", body)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if body:
            self._send_body(relative, start, end)

    def _send_body(self, path: str, start: int, end: int) -> None:
        self.server.body_started()
        written = False
        try:
            self._write_body(path, start, end)
            written = True
        finally:
            self.server.body_ended((path, start, end) if written else None)

    def _write_body(self, path: str, start: int, end: int) -> None:
        faults = self.server.faults
        corrupt = faults.take(faults.corrupt, path, start)
        stop = start + (end - start) // 2 if faults.take(faults.truncate, path, start) else end
        with self.server.files.open(path) as f:
            zero_copy = not corrupt and _has_fileno(f)
            position = start
            while position < stop:
                size = min(_SEND_PIECE, stop - position)
                if self.server.bucket is not None:
                    self.server.bucket.take(size)
                if zero_copy:  # the kernel moves page-cache pages to the socket: no copy through Python
                    sent = os.sendfile(self.connection.fileno(), f.fileno(), position, size)
                else:
                    f.seek(position)
                    piece = f.read(size)
                    if corrupt and piece:
                        piece = bytes([piece[0] ^ 0xFF]) + piece[1:]
                        corrupt = False
                    self.wfile.write(piece)
                    sent = len(piece)
                if not sent:
                    break
                position += sent
                with self.server.stats_lock:  # per piece: a transfer cut short still cost the origin its bytes
                    self.server.bytes_sent += sent
        if stop < end:
            self.close_connection = True  # the client sees fewer bytes than Content-Length said


def _has_fileno(f: BinaryIO) -> bool:
    try:
        f.fileno()
    except (OSError, AttributeError, io.UnsupportedOperation):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m servelm.delivery.file_server DIR --port P [--rate-mb-s R]`: an origin for benchmarks."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--rate-mb-s", type=float, default=None, help="egress cap over all connections (MB/s)")
    args = parser.parse_args(argv)
    server = RangeFileServer(DirectoryFiles(args.directory), args.host, args.port,
                             args.rate_mb_s * 1e6 if args.rate_mb_s else None)  # fmt: skip
    print(f"serving {args.directory} at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
