"""A remote --model loads while it downloads: tensors are read as their chunks arrive, and the
model that comes out is the one a local load builds."""

from __future__ import annotations

import re
import shutil

import httpx
import pytest
import torch

from servelm.config import EngineConfig
from servelm.delivery.file_server import DirectoryFiles, RangeFileServer
from servelm.delivery.manifest import MANIFEST_NAME, write_manifest
from servelm.delivery.sources import open_source
from servelm.delivery.streaming import start_pull
from servelm.engine.builder import build_engine
from servelm.obs.startup import StartupTimeline
from servelm.server.launcher import launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

CHUNK_BYTES = 256 << 10
RATE_BYTES_PER_S = 12e6  # the ~43 MB checkpoint takes ~3.6 s to arrive: the metadata's share is small


@pytest.fixture(scope="module")
def origin_dir(tmp_path_factory):
    # Wide layers, so most bytes sit in the layers (after the embeddings) and loading them overlaps the fetch.
    directory = write_tiny_checkpoint(
        tmp_path_factory.mktemp("origin") / "streamed", seed=11, hidden_size=64, intermediate_size=1536,
        num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, max_shard_size="8MB",
    )  # fmt: skip
    write_manifest(directory, CHUNK_BYTES)
    return directory


def test_streaming_load_overlaps_the_fetch_and_matches_a_local_load(origin_dir, tmp_path):
    server = RangeFileServer(DirectoryFiles(origin_dir), rate_bytes_per_s=RATE_BYTES_PER_S).start()
    try:
        startup = StartupTimeline()
        config = EngineConfig.from_flat(model=server.url, download_dir=str(tmp_path / "downloads"), num_blocks=64)
        remote = build_engine(config, startup=startup)
    finally:
        server.stop()
    phases = {record.name: record for record in startup.records}
    fetch, load = phases["fetch"], phases["load"]
    # Loading began before the last byte arrived (by order of events, not a share of the fetch's
    # time: that fails on a slower or busier machine). Not that it ended after the fetch: the last
    # chunk stored may hold no tensor (a file's tail, the tokenizer), and a loaded 2-core host saw
    # the load end 22 ms before it; the parameters' equality below says every tensor's bytes came.
    assert fetch.started_at <= load.started_at < fetch.ended_at, (fetch, load)

    pulled = next((tmp_path / "downloads").iterdir())
    for original in origin_dir.iterdir():
        if original.is_file() and original.name != MANIFEST_NAME:
            assert (pulled / original.name).read_bytes() == original.read_bytes(), original.name
    assert (pulled / MANIFEST_NAME).is_file()  # complete: the next start uses it as it is

    # Streamed tensor by tensor, out of file order: every parameter is what a local load reads.
    local = build_engine(EngineConfig.from_flat(model=str(origin_dir), num_blocks=64))
    streamed, expected = remote.core.runner.model.state_dict(), local.core.runner.model.state_dict()
    assert streamed.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(streamed[name], tensor), name


def test_serve_pulls_a_remote_model_and_exports_its_start_up_phases(origin_dir, tmp_path):
    server = RangeFileServer(DirectoryFiles(origin_dir)).start()
    try:
        args = ["--download-dir", str(tmp_path / "downloads"), "--num-blocks", "64", "--num-threads", "1"]
        with launch_server(server.url, args) as serving:
            metrics = httpx.get(f"{serving.base_url}/metrics").text
            body = {"prompt": "Pulled and served", "max_tokens": 4, "temperature": 0}
            completion = httpx.post(f"{serving.base_url}/v1/completions", json=body, timeout=60)
    finally:
        server.stop()
    assert completion.status_code == 200, completion.text
    for phase in ("fetch", "load", "kv_sizing", "warmup"):
        assert re.search(rf'servelm:startup_seconds\{{[^}}]*phase="{phase}"[^}}]*\}} [0-9.e-]+', metrics), phase


def test_serve_refuses_a_remote_model_whose_files_differ_from_their_manifest(origin_dir, tmp_path):
    tampered = tmp_path / "tampered"
    shutil.copytree(origin_dir, tampered)
    shard = sorted(tampered.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last chunk of the last shard no longer matches the manifest
    shard.write_bytes(bytes(data))
    server = RangeFileServer(DirectoryFiles(tampered)).start()
    try:
        args = ["--download-dir", str(tmp_path / "downloads"), "--num-blocks", "64", "--pull-connections", "2"]
        with pytest.raises(RuntimeError) as failure:
            launch_server(server.url, args, startup_timeout_s=120)
    finally:
        server.stop()
    assert f"{shard.name}#" in str(failure.value) and "differ from its manifest" in str(failure.value)
    assert not list((tmp_path / "downloads").glob(f"*/{MANIFEST_NAME}")), "nothing marked complete"


def test_an_interrupted_pull_resumes_after_verifying_what_it_held(origin_dir, tmp_path):
    """A start-up after a crash re-hashes the chunks the journal lists (the `verify` phase): one
    whose bytes went bad on disk is fetched again, the rest are not."""
    server = RangeFileServer(DirectoryFiles(origin_dir), rate_bytes_per_s=RATE_BYTES_PER_S).start()
    downloads = tmp_path / "downloads"
    try:
        first = start_pull(open_source(server.url), server.url, downloads, connections=2)
        assert first.store.wait_for(first.manifest.chunks()[:40], timeout_s=60)
        first.puller.stop()  # the crash: journal kept, no completion mark
        first.store.close()
        held = sorted(first.store.held_keys())
        spoiled = first.manifest.chunks()[3]
        assert spoiled.key in held
        with (first.directory / spoiled.file).open("r+b") as f:
            f.seek(spoiled.offset)
            f.write(b"\x00" * 16)
        # A body the puller held may be logged by the server's writer thread a moment later: count
        # the first pull's requests once all are in, or one shows up as fetched again.
        assert server.wait_for_bodies()
        requests_before = len(server.requests)
        startup = StartupTimeline()
        config = EngineConfig.from_flat(model=server.url, download_dir=str(downloads), num_blocks=64)
        build_engine(config, startup=startup)
        refetched = [(path, start) for path, start, _ in server.requests[requests_before:]]
    finally:
        server.stop()
    assert "verify" in startup.seconds_by_phase()
    assert (spoiled.file, spoiled.offset) in refetched
    kept = [c for c in first.manifest.chunks() if c.key in held and c.key != spoiled.key]
    assert not any((c.file, c.offset) in refetched for c in kept), "a verified chunk was fetched again"
    for original in origin_dir.iterdir():
        if original.is_file() and original.name != MANIFEST_NAME:
            assert (first.directory / original.name).read_bytes() == original.read_bytes(), original.name
