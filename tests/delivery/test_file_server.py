"""RangeFileServer's own edges: Range forms, and what a client cut off mid-body costs the origin."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx

from servelm.delivery.file_server import DirectoryFiles, RangeFileServer


def test_range_forms(model_dir: Path, origin: RangeFileServer) -> None:
    data = (model_dir / "config.json").read_bytes()
    with httpx.Client(base_url=origin.url, timeout=10) as client:
        assert client.get("config.json", headers={"Range": "bytes=-21"}).content == data[-21:]
        tail = client.get("config.json", headers={"Range": "bytes=300-"})
        assert tail.status_code == 206 and tail.content == data[300:]
        assert tail.headers["Content-Range"] == f"bytes 300-{len(data) - 1}/{len(data)}"
        assert client.get("config.json", headers={"Range": f"bytes={len(data)}-"}).status_code == 416
        assert client.get("config.json", headers={"Range": "items=0-1"}).status_code == 416
        assert client.head("config.json").headers["Content-Length"] == str(len(data))


def test_a_client_cut_off_mid_body_is_counted_in_bytes_not_in_requests(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(os.urandom(8 << 20))
    server = RangeFileServer(DirectoryFiles(tmp_path), rate_bytes_per_s=20e6).start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as client:
            client.sendall(b"GET /big HTTP/1.1\r\nHost: origin\r\n\r\n")
            assert client.recv(65536)
        deadline = time.monotonic() + 10
        while server.stats()["bytes_sent"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the handler notices the reset
        stats = server.stats()
        assert 0 < stats["bytes_sent"] < 8 << 20 and stats["requests"] == []
    finally:
        server.stop()
