"""`servelm manifest` and `servelm pull` as processes: a pull killed half-way resumes without
fetching again what it had, and an origin whose files differ from its manifest fails clearly."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from delivery_helpers import CHUNK_BYTES, same_files, write_model_dir

from servelm.delivery.file_server import DirectoryFiles, RangeFileServer
from servelm.delivery.manifest import MANIFEST_NAME, build_manifest, read_manifest
from servelm.delivery.store import STATE_DIR

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
BIG = {"model-00001-of-00002.safetensors": 24 * CHUNK_BYTES + 100, "model-00002-of-00002.safetensors": 24 * CHUNK_BYTES}
CONNECTIONS = 4


def servelm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "servelm.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_servelm_manifest(model_dir: Path) -> None:
    (model_dir / MANIFEST_NAME).unlink()
    done = servelm("manifest", str(model_dir), "--chunk-mb", str(CHUNK_BYTES / (1 << 20)))
    assert done.returncode == 0, done.stderr
    manifest = read_manifest(model_dir)
    assert manifest.chunk_bytes == CHUNK_BYTES
    assert "4 files, 11 chunks" in done.stdout and f"{manifest.total_bytes} bytes" in done.stdout
    assert manifest.digest in done.stdout
    assert servelm("manifest", str(model_dir / "nope")).returncode == 1


@pytest.fixture
def slow_origin(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`python -m servelm.delivery.file_server` capped at 2 MB/s over ~3.2 MB: a pull takes ~1.6 s."""
    directory = write_model_dir(tmp_path / "origin", BIG, seed=3)
    process = subprocess.Popen(
        [sys.executable, "-m", "servelm.delivery.file_server", str(directory), "--rate-mb-s", "2"],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], 30)
    assert ready, "the origin did not start"
    url = process.stdout.readline().split()[-1]
    yield url, directory
    process.kill()
    process.wait(timeout=10)


def test_a_killed_pull_resumes_without_fetching_twice(slow_origin: tuple[str, Path], tmp_path: Path) -> None:
    url, origin = slow_origin
    manifest = read_manifest(origin)
    total = len(manifest.chunks())
    dest = tmp_path / "dest"
    journal = dest / STATE_DIR / "journal"
    pull = [sys.executable, "-m", "servelm.cli", "pull", url, "--to", str(dest), "--connections", str(CONNECTIONS),
            "--no-progress"]  # fmt: skip
    first = subprocess.Popen(pull, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.monotonic() + 30
    while not (journal.is_file() and len(journal.read_text().splitlines()) >= total // 2):
        assert time.monotonic() < deadline and first.poll() is None, "the pull did not get half-way"
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    held = set(journal.read_text().splitlines())
    assert total // 2 <= len(held) < total and not (dest / MANIFEST_NAME).exists()

    done = servelm("pull", url, "--to", str(dest), "--connections", str(CONNECTIONS), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert f"{len(held)} resumed" in done.stdout and f"{total - len(held)} chunks fetched" in done.stdout
    assert same_files(origin, dest, BIG) and read_manifest(dest) == manifest
    assert not (dest / STATE_DIR).exists()

    requests = httpx.get(url + "_servelm/stats", timeout=10).json()["requests"]
    fetched = Counter((path, start) for path, start, _ in requests)
    assert set(fetched) == {(chunk.file, chunk.offset) for chunk in manifest.chunks()}
    twice = {f"{path}#{start // CHUNK_BYTES}" for (path, start), n in fetched.items() if n > 1}
    assert max(fetched.values()) <= 2 and len(twice) <= CONNECTIONS  # only those in flight at the kill
    assert not twice & held  # a journaled chunk is never fetched again


def test_an_origin_that_differs_from_its_manifest(model_dir: Path, origin: RangeFileServer, tmp_path: Path) -> None:
    shard = model_dir / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[2 * CHUNK_BYTES + 5] ^= 0x01  # after `servelm manifest` ran
    shard.write_bytes(bytes(data))
    done = servelm("pull", origin.url, "--to", str(tmp_path / "dest"), "--max-attempts", "2", "--no-progress")
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("servelm pull: chunk model-00001-of-00002.safetensors#2 ")
    assert "the origin's files differ from its manifest" in error
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists() and done.stdout == ""


@pytest.fixture
def plain_http_origin(tmp_path: Path) -> Iterator[tuple[str, Path, subprocess.Popen[str]]]:
    """`python -m http.server` over a model directory: an origin that ignores Range (200, the whole file)."""
    directory = write_model_dir(tmp_path / "origin", BIG, seed=5)
    process = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(directory)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], 30)
    assert ready, "http.server did not start"
    port = process.stdout.readline().split(" port ")[1].split()[0]
    yield f"http://127.0.0.1:{port}/", directory, process
    process.kill()
    process.wait(timeout=10)


def test_pull_from_an_origin_that_ignores_range_reads_each_file_whole(
    plain_http_origin: tuple[str, Path, subprocess.Popen[str]], tmp_path: Path
) -> None:
    url, origin, process = plain_http_origin
    dest = tmp_path / "dest"
    done = servelm("pull", url, "--to", str(dest), "--connections", str(CONNECTIONS), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "ignores Range" in done.stderr  # said once, as a warning
    assert same_files(origin, dest, BIG) and read_manifest(dest) == read_manifest(origin)
    process.kill()
    _, log = process.communicate(timeout=10)
    # 24 chunks each: a few ranged tries (one per connection at most), then one pass, not a whole file
    # per chunk. A thread that falls behind on a loaded machine may ask for a chunk after its bytes
    # left the shared window, which costs a fresh pass (whole_file.py: correct, only slower): the
    # suite on two workers once saw 6 GETs of a file where 5 was the bound; two such passes allowed.
    for name in BIG:
        gets = sum(1 for line in log.splitlines() if f'"GET /{name} ' in line)
        assert 1 <= gets <= CONNECTIONS + 1 + 2, (name, gets)


def test_manifest_of_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("not a model")
    for directory, found in ((empty, "no files"), (notes, "README.md")):
        done = servelm("manifest", str(directory))
        assert done.returncode == 1 and "holds no model weights" in done.stderr and found in done.stderr, done.stderr
        assert ".safetensors" in done.stderr and not (directory / MANIFEST_NAME).exists()


def test_pull_of_a_manifest_without_weights_is_refused(tmp_path: Path) -> None:
    origin = tmp_path / "origin"  # published before manifests were checked: config.json alone
    origin.mkdir()
    (origin / "config.json").write_text("{}")
    (origin / MANIFEST_NAME).write_text(build_manifest(origin, CHUNK_BYTES).to_json())
    server = RangeFileServer(DirectoryFiles(origin)).start()
    try:
        done = servelm("pull", server.url, "--to", str(tmp_path / "dest"), "--no-progress")
    finally:
        server.stop()
    assert done.returncode == 1 and "holds no model weights" in done.stderr, done.stderr
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists()
