"""The manifest (round trip, chunk arithmetic, malformed or tampered ones rejected) and the
ChunkStore (verified writes, resume from the journal, another version starts over)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from delivery_helpers import CHUNK_BYTES, FILES

from servelm.delivery.manifest import MANIFEST_NAME, Manifest, ManifestError, build_manifest, read_manifest
from servelm.delivery.store import STATE_DIR, ChunkCorruptError, ChunkStore


def test_manifest_round_trip_and_chunks(model_dir: Path) -> None:
    manifest = read_manifest(model_dir)
    assert Manifest.from_json(manifest.to_json()) == manifest == build_manifest(model_dir, CHUNK_BYTES)
    assert manifest.total_bytes == sum(FILES.values())
    assert [len(manifest.file(path).chunks) for path in FILES] == [6, 1, 1, 3]
    for chunk in manifest.chunks():
        data = (model_dir / chunk.file).read_bytes()[chunk.offset : chunk.end]
        assert chunk.verify(data) and len(data) == chunk.length
    shard = manifest.file("model-00001-of-00002.safetensors")
    assert shard.chunks[-1].length == 1234 and shard.chunks[-1].end == shard.size
    assert manifest.file("empty.txt").chunks[0].length == 0


def test_chunks_covering(model_dir: Path) -> None:
    manifest = read_manifest(model_dir)
    shard = manifest.file("model-00001-of-00002.safetensors").chunks
    path = shard[0].file
    assert manifest.chunks_covering(path, 0, 1) == [shard[0]]
    assert manifest.chunks_covering(path, 0, CHUNK_BYTES) == [shard[0]]
    assert manifest.chunks_covering(path, CHUNK_BYTES - 1, CHUNK_BYTES + 1) == [shard[0], shard[1]]
    assert manifest.chunks_covering(path, CHUNK_BYTES, 3 * CHUNK_BYTES) == [shard[1], shard[2]]
    assert manifest.chunks_covering(path, 5 * CHUNK_BYTES + 1000, 5 * CHUNK_BYTES + 1234) == [shard[5]]
    assert manifest.chunks_covering(path, 10, 10) == []
    with pytest.raises(KeyError):
        manifest.chunks_covering("nope", 0, 1)


def _tampered(manifest: Manifest, edit) -> str:
    raw = json.loads(manifest.to_json())
    edit(raw)
    return json.dumps(raw)


@pytest.mark.parametrize(
    "edit, complaint",
    [
        (lambda raw: raw["files"][0].update(path="../../etc/cron.d/x"), "bad manifest entry"),
        (lambda raw: raw["files"][0].update(path="/etc/passwd"), "bad manifest entry"),
        (lambda raw: raw["files"][0].update(path=".servelm-pull/journal"), "bad manifest entry"),
        (lambda raw: raw["files"][0].update(path=".git/hooks/post-checkout"), "bad manifest entry"),
        (lambda raw: raw["files"][0].update(path="servelm-manifest.json"), "bad manifest entry"),
        (lambda raw: raw["files"][0].update(path="sub//x"), "bad manifest entry"),
        (lambda raw: raw["files"][1].update(path=raw["files"][0]["path"]), "listed twice"),
        (lambda raw: raw["files"][0].update(size=-1), "bad manifest entry"),
        (lambda raw: raw["files"][0]["chunks"].__setitem__(0, "not-a-digest"), "sha256 hex"),
        (lambda raw: raw.update(chunk_bytes="many"), "not a servelm manifest"),
        (lambda raw: raw["files"][0].update(size=raw["files"][0]["size"] + CHUNK_BYTES), "chunk hashes"),
        (lambda raw: raw["files"][0]["chunks"].pop(), "chunk hashes"),
        (lambda raw: raw.update(chunk_bytes=0), "bad manifest entry"),
        (lambda raw: raw.update(format=2), "format"),
        (lambda raw: raw.pop("files"), "not a servelm manifest"),
    ],
)
def test_tampered_manifest_rejected(model_dir: Path, edit, complaint: str) -> None:
    with pytest.raises(ManifestError, match=complaint):
        Manifest.from_json(_tampered(read_manifest(model_dir), edit))


def test_a_changed_hash_is_another_version(model_dir: Path) -> None:
    manifest = read_manifest(model_dir)
    other = Manifest.from_json(_tampered(manifest, lambda raw: raw["files"][0]["chunks"].__setitem__(0, "0" * 64)))
    assert other.digest != manifest.digest and other != manifest
    with pytest.raises(ManifestError, match="not a servelm manifest"):
        Manifest.from_json("{not json")
    (model_dir / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError, match="servelm manifest"):
        read_manifest(model_dir)


def _fill(store: ChunkStore, origin: Path, count: int | None = None) -> None:
    for chunk in store.missing()[:count]:
        assert store.write(chunk, (origin / chunk.file).read_bytes()[chunk.offset : chunk.end])


def test_store_resumes_from_its_journal(model_dir: Path, tmp_path: Path) -> None:
    manifest = read_manifest(model_dir)
    store = ChunkStore.open(tmp_path / "dest", manifest)
    _fill(store, model_dir, 4)
    store.close()  # a crash: no finish

    resumed = ChunkStore.open(tmp_path / "dest", manifest)
    first_four = {chunk.key for chunk in manifest.chunks()[:4]}
    assert resumed.resumed_chunks == 4 and resumed.held_keys() == first_four
    assert [chunk.key for chunk in resumed.missing()] == [chunk.key for chunk in manifest.chunks()[4:]]
    assert not resumed.write(manifest.chunks()[0], (model_dir / manifest.chunks()[0].file).read_bytes()[:CHUNK_BYTES])
    _fill(resumed, model_dir)
    assert ChunkStore.complete_manifest(tmp_path / "dest") is None  # not finished yet
    resumed.finish()
    assert ChunkStore.complete_manifest(tmp_path / "dest") == manifest
    assert not (tmp_path / "dest" / STATE_DIR).exists()
    assert all((tmp_path / "dest" / name).read_bytes() == (model_dir / name).read_bytes() for name in FILES)
    assert ChunkStore.open(tmp_path / "dest", manifest).is_complete()


def test_store_with_another_manifest_starts_over(model_dir: Path, tmp_path: Path) -> None:
    manifest = read_manifest(model_dir)
    store = ChunkStore.open(tmp_path / "dest", manifest)
    _fill(store, model_dir)
    store.finish()
    (model_dir / "config.json").write_bytes(b'{"changed": true}')
    (model_dir / "model-00001-of-00002.safetensors").unlink()  # the new version has no such shard
    (tmp_path / "dest" / "notes.txt").write_text("the user's own")
    newer = build_manifest(model_dir, CHUNK_BYTES)
    restarted = ChunkStore.open(tmp_path / "dest", newer)
    assert restarted.resumed_chunks == 0 and not restarted.held_keys()
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists()  # the old version's completion mark is gone
    assert (tmp_path / "dest" / "config.json").stat().st_size == len(b'{"changed": true}')
    assert not (tmp_path / "dest" / "model-00001-of-00002.safetensors").exists()  # no stale shard to load
    assert (tmp_path / "dest" / "notes.txt").read_text() == "the user's own"
    restarted.close()


def test_a_crash_between_completion_mark_and_cleanup_resumes_complete(model_dir: Path, tmp_path: Path) -> None:
    manifest = read_manifest(model_dir)
    store = ChunkStore.open(tmp_path / "dest", manifest)
    _fill(store, model_dir)
    store.close()
    (tmp_path / "dest" / MANIFEST_NAME).write_text(manifest.to_json())  # finish() got this far
    assert ChunkStore.complete_manifest(tmp_path / "dest") is None  # the state is still there
    resumed = ChunkStore.open(tmp_path / "dest", manifest)
    assert resumed.is_complete() and resumed.resumed_chunks == len(manifest.chunks())
    resumed.finish()
    assert ChunkStore.complete_manifest(tmp_path / "dest") == manifest


def test_a_corrupt_write_raises_and_writes_nothing(model_dir: Path, tmp_path: Path) -> None:
    manifest = read_manifest(model_dir)
    store = ChunkStore.open(tmp_path / "dest", manifest)
    chunk = manifest.file("model-00001-of-00002.safetensors").chunks[1]
    good = (model_dir / chunk.file).read_bytes()[chunk.offset : chunk.end]
    bad = bytes([good[0] ^ 1]) + good[1:]
    with pytest.raises(ChunkCorruptError, match=chunk.key):
        store.write(chunk, bad)
    with pytest.raises(ChunkCorruptError):
        store.write(chunk, good[:-1])  # short
    assert not store.has(chunk) and not store.wait_for([chunk], timeout_s=0.01)
    on_disk = (tmp_path / "dest" / chunk.file).read_bytes()[chunk.offset : chunk.end]
    assert on_disk == bytes(chunk.length)  # still the sparse file's zeros
    assert (tmp_path / "dest" / STATE_DIR / "journal").read_text() == ""
    assert store.write(chunk, good) and store.wait_for([chunk], timeout_s=0.01)
    assert (
        hashlib.sha256((tmp_path / "dest" / chunk.file).read_bytes()[chunk.offset : chunk.end]).hexdigest()
        == chunk.sha256
    )
    store.close()
