"""Pulls over real HTTP (a RangeFileServer in a thread) and from a local path: byte-identical
files, injected faults detected and re-fetched, a missing file a clear error."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from delivery_helpers import FILES, same_files

from servelm.delivery.commands import pull, pull_from
from servelm.delivery.file_server import Faults, RangeFileServer
from servelm.delivery.http_source import HttpSource
from servelm.delivery.local_source import LocalSource
from servelm.delivery.manifest import MANIFEST_NAME, ChunkRef, ManifestError, read_manifest
from servelm.delivery.pull import Puller, PullError
from servelm.delivery.source import FetchError
from servelm.delivery.sources import is_remote, open_source
from servelm.delivery.store import ChunkStore


def _requests(origin: RangeFileServer) -> Counter[tuple[str, int]]:
    return Counter((path, start) for path, start, _ in origin.requests)


def test_pull_over_http_is_byte_identical(model_dir: Path, origin: RangeFileServer, tmp_path: Path) -> None:
    stats = pull(origin.url, tmp_path / "dest", connections=4)
    manifest = read_manifest(model_dir)
    assert same_files(model_dir, tmp_path / "dest")
    assert read_manifest(tmp_path / "dest") == manifest
    assert (stats.chunks_fetched, stats.chunks_resumed, stats.bytes_fetched) == (11, 0, sum(FILES.values()))
    assert stats.corrupt_reads == stats.failed_reads == 0
    assert _requests(origin) == Counter((chunk.file, chunk.offset) for chunk in manifest.chunks())
    again = pull(origin.url, tmp_path / "dest", connections=4)  # complete already: nothing fetched
    assert (again.chunks_fetched, again.chunks_resumed) == (0, 11) and len(origin.requests) == 11


def test_a_corrupted_chunk_is_detected_and_fetched_again(
    model_dir: Path, origin: RangeFileServer, faults: Faults, tmp_path: Path
) -> None:
    chunk = read_manifest(model_dir).file("model-00001-of-00002.safetensors").chunks[3]
    faults.corrupt.add((chunk.file, chunk.offset))
    source = HttpSource(origin.url, connections=4)
    stats = pull_from(source, tmp_path / "dest", connections=4)
    source.close()
    assert (stats.corrupt_reads, stats.failed_reads, stats.chunks_fetched) == (1, 0, 11)
    assert _requests(origin)[(chunk.file, chunk.offset)] == 2
    assert same_files(model_dir, tmp_path / "dest")


def test_a_truncated_response_is_fetched_again(
    model_dir: Path, origin: RangeFileServer, faults: Faults, tmp_path: Path
) -> None:
    chunk = read_manifest(model_dir).file("sub dir/we#ird %+name?.bin").chunks[1]
    faults.truncate.add((chunk.file, chunk.offset))
    stats = pull(origin.url, tmp_path / "dest", connections=3)
    assert (stats.corrupt_reads, stats.failed_reads, stats.chunks_fetched) == (0, 1, 11)
    assert _requests(origin)[(chunk.file, chunk.offset)] == 2
    assert same_files(model_dir, tmp_path / "dest")


def test_a_file_missing_at_the_origin_is_a_clear_error(
    model_dir: Path, origin: RangeFileServer, tmp_path: Path
) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(PullError, match=r"config\.json#0 .*failed 2 times.*missing at the origin") as failed:
        pull(origin.url, tmp_path / "dest", connections=2, max_attempts=2)
    assert "differ from its manifest" not in str(failed.value)  # a read error, not bad bytes
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists()


def test_pull_from_a_local_path(model_dir: Path, tmp_path: Path) -> None:
    stats = pull(str(model_dir), tmp_path / "dest", connections=4)
    assert stats.chunks_fetched == 11 and same_files(model_dir, tmp_path / "dest")
    source = LocalSource(model_dir)
    chunk = read_manifest(model_dir).file("model-00001-of-00002.safetensors").chunks[5]
    with (model_dir / chunk.file).open("r+b") as f:
        f.truncate(chunk.offset + 10)
    with pytest.raises(FetchError, match="10 bytes, expected 1234"):
        source.read(chunk)
    (model_dir / "config.json").unlink()
    with pytest.raises(FetchError, match="missing at the origin"):
        source.read(read_manifest(model_dir).file("config.json").chunks[0])
    source.close()
    with pytest.raises(ManifestError, match="servelm manifest"):
        pull(str(tmp_path / "no-model"), tmp_path / "dest2")


class _GatedSource(LocalSource):
    """A LocalSource whose read of one chunk waits for the test's go, counting every read."""

    def __init__(self, directory: Path, gated: str) -> None:
        super().__init__(directory)
        self.gated, self.reads = gated, Counter[str]()
        self.entered, self.go = threading.Event(), threading.Event()

    def read(self, chunk: ChunkRef) -> bytes:
        self.reads[chunk.key] += 1
        if chunk.key == self.gated:
            self.entered.set()
            assert self.go.wait(10)
        return super().read(chunk)


def test_prioritizing_a_chunk_in_flight_does_not_read_it_twice(model_dir: Path, tmp_path: Path) -> None:
    manifest = read_manifest(model_dir)
    gated = manifest.file("model-00001-of-00002.safetensors").chunks[0]
    source = _GatedSource(model_dir, gated.key)
    puller = Puller(source, ChunkStore.open(tmp_path / "dest", manifest), connections=3).start()
    assert source.entered.wait(10)
    puller.prioritize([gated])  # the streaming loader wants it: it is being read already
    time.sleep(0.2)  # the other two connections finish the rest meanwhile
    source.go.set()
    stats = puller.wait(timeout_s=10)
    assert source.reads[gated.key] == 1 and stats.chunks_fetched == len(manifest.chunks())
    assert same_files(model_dir, tmp_path / "dest")


def test_source_specs() -> None:
    assert not is_remote("models/llama") and not is_remote("/abs/we:ird") and not is_remote("C:stuff")
    assert all(is_remote(spec) for spec in ("http://h/m", "HTTPS://h/m", "s3://b/p", "peer://h:1", "ftp://h"))
    assert isinstance(open_source("models/llama"), LocalSource)
    assert open_source("https://hub.example/org/model").description == "https://hub.example/org/model/"
    assert open_source("peer://10.0.0.7:8000").description == "http://10.0.0.7:8000/servelm/model/"
    with pytest.raises(ValueError, match="accepted: a local path, http://, https://, s3://, peer://"):
        open_source("ftp://h/m")
    with pytest.raises(ValueError, match="peer://HOST:PORT"):
        open_source("peer://host-without-port")
    with pytest.raises(ValueError, match="s3://BUCKET/PREFIX"):
        open_source("s3:///prefix-without-bucket")
