"""HttpSource against real servers: our RangeFileServer (ranges, 409, 404, a truncated body),
the standard library's file server (which ignores Range), and one that answers wrongly."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from delivery_helpers import FILES

from servelm.delivery.file_server import DirectoryFiles, Faults, RangeFileServer
from servelm.delivery.http_source import HttpSource
from servelm.delivery.manifest import ManifestError, read_manifest
from servelm.delivery.source import FetchError, NotYetAvailableError
from servelm.delivery.whole_file import WholeFileStreams


def _serve(server: ThreadingHTTPServer) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


def test_reads_every_chunk_exactly_with_quoted_paths(model_dir: Path, origin: RangeFileServer) -> None:
    source = HttpSource(origin.url, connections=4)
    try:
        manifest = source.fetch_manifest()
        assert manifest == read_manifest(model_dir)
        assert {entry.path for entry in manifest.files} == set(FILES)
        for chunk in manifest.chunks():
            data = source.read(chunk)
            assert data == (model_dir / chunk.file).read_bytes()[chunk.offset : chunk.end]
            assert chunk.verify(data)
    finally:
        source.close()
    assert "/sub%20dir/we%23ird%20%25%2Bname%3F.bin" in source.url("sub dir/we#ird %+name?.bin")


def test_missing_manifest_points_at_servelm_manifest(model_dir: Path, origin: RangeFileServer) -> None:
    (model_dir / "servelm-manifest.json").unlink()
    source = HttpSource(origin.url, connections=1)
    with pytest.raises(ManifestError, match="servelm manifest"):
        source.fetch_manifest()
    source.close()


def test_missing_file_and_unheld_range_and_truncation(model_dir: Path, origin: RangeFileServer, faults: Faults) -> None:
    manifest = read_manifest(model_dir)
    chunk = manifest.file("model-00001-of-00002.safetensors").chunks[2]
    source = HttpSource(origin.url, connections=2)
    faults.truncate.add((chunk.file, chunk.offset))
    with pytest.raises(FetchError, match=f"{chunk.key}") as truncated:
        source.read(chunk)
    assert not isinstance(truncated.value, NotYetAvailableError)
    assert source.read(chunk) == (model_dir / chunk.file).read_bytes()[chunk.offset : chunk.end]  # the pool recovers
    (model_dir / chunk.file).unlink()
    with pytest.raises(FetchError, match="missing at the origin") as missing:
        source.read(chunk)
    assert chunk.key in str(missing.value) and origin.url in str(missing.value)
    source.close()


class _NothingHeld(DirectoryFiles):
    def available(self, path: str, start: int, end: int) -> bool:
        return False


def test_a_peer_that_does_not_hold_the_chunk_yet(model_dir: Path) -> None:
    server = RangeFileServer(_NothingHeld(model_dir)).start()
    source = HttpSource(server.url, connections=1)
    try:
        with pytest.raises(NotYetAvailableError):
            source.read(read_manifest(model_dir).chunks()[0])
    finally:
        source.close()
        server.stop()


@pytest.fixture
def plain_server(model_dir: Path) -> Iterator[str]:
    """http.server's file server: answers every GET with 200 and the whole file, Range or not."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(model_dir))
    yield from _serve(ThreadingHTTPServer(("127.0.0.1", 0), handler))


def test_a_server_without_range_is_read_a_whole_file_at_a_time(model_dir: Path, plain_server: str) -> None:
    manifest = read_manifest(model_dir)
    source = HttpSource(plain_server, connections=1)
    try:
        config = manifest.file("config.json").chunks[0]
        assert source.read(config) == (model_dir / "config.json").read_bytes()
        assert source.read(manifest.file("empty.txt").chunks[0]) == b""
        shard = manifest.file("model-00001-of-00002.safetensors")
        content = (model_dir / shard.path).read_bytes()
        for chunk in (shard.chunks[1], shard.chunks[4], shard.chunks[2], shard.chunks[0], shard.chunks[5]):
            assert source.read(chunk) == content[chunk.offset : chunk.end]  # any order, from the stream
    finally:
        source.close()


def test_a_chunk_that_left_the_window_is_read_again_from_a_new_pass(model_dir: Path, plain_server: str) -> None:
    shard = read_manifest(model_dir).file("model-00001-of-00002.safetensors")
    content = (model_dir / shard.path).read_bytes()
    opened: list[str] = []
    source = HttpSource(plain_server, connections=1)

    def open_file(path: str):  # counts the passes over each file
        opened.append(path)
        return source._open_whole_file(path)

    streams = WholeFileStreams(open_file, max_window_bytes=2 * shard.chunks[0].length)
    try:
        for chunk in (shard.chunks[0], shard.chunks[1], shard.chunks[4], shard.chunks[3], shard.chunks[0]):
            assert streams.read(chunk) == content[chunk.offset : chunk.end]
        assert opened == [shard.path, shard.path]  # chunk 0 had left the 2-chunk window: one more pass
    finally:
        streams.close()
        source.close()


class _WrongAnswers(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.endswith("/500"):
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b"x" * (20 if self.path.endswith("/long") else 10)  # /long: the range it names, twice the bytes
        self.send_response(206)
        self.send_header("Content-Range", "bytes 0-9/100")  # whatever was asked
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def wrong_server() -> Iterator[str]:
    yield from _serve(ThreadingHTTPServer(("127.0.0.1", 0), _WrongAnswers))


def test_server_errors_and_wrong_ranges_are_fetch_errors(wrong_server: str) -> None:
    from servelm.delivery.manifest import ChunkRef

    source = HttpSource(wrong_server + "m/", connections=1)
    try:
        with pytest.raises(FetchError, match="HTTP 500"):
            source.read(ChunkRef("500", 0, 0, 10, "0" * 64))
        with pytest.raises(FetchError, match="Content-Range"):
            source.read(ChunkRef("f", 1, 10, 10, "0" * 64))
        with pytest.raises(FetchError, match="more than the 10 bytes"):
            source.read(ChunkRef("long", 0, 0, 10, "0" * 64))
        assert source.read(ChunkRef("f", 0, 0, 10, "0" * 64)) == b"x" * 10  # a matching range is fine
    finally:
        source.close()


def test_an_unreachable_origin_is_a_fetch_error(model_dir: Path) -> None:
    server = RangeFileServer(DirectoryFiles(model_dir))
    url = server.url
    server.server_close()  # the port is free again: nobody listens there
    source = HttpSource(url, connections=1, timeout_s=5)
    with pytest.raises(FetchError, match=url):
        source.read(read_manifest(model_dir).chunks()[0])
    with pytest.raises(FetchError):
        source.fetch_manifest()
    source.close()
