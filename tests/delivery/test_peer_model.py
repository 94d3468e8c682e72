"""A new replica takes its weights from a running one (`--model peer://HOST:PORT`), as SGLang's
R-Fork and Dynamo's ModelExpress grow a fleet without going back to the origin."""

from __future__ import annotations

import shutil

import httpx
import pytest

from servelm.default_model import default_model_path
from servelm.delivery.manifest import MANIFEST_NAME, Manifest
from servelm.models.loader import load_checkpoint
from servelm.server.launcher import launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

KEY = "peer-test-key"
ARGS = ["--num-blocks", "64", "--num-threads", "1"]


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("peer") / "tiny-peer", seed=21)
    with launch_server(model, ARGS, env={"SERVELM_API_KEY": KEY}) as server:
        yield model, server


def _complete(base_url: str, model: str) -> dict:
    body = {"model": model, "prompt": "A replica forked from another", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_a_replica_started_from_a_peer_serves_the_same_model(running, tmp_path):
    model, first = running
    downloads = tmp_path / "downloads"
    peer = f"peer://127.0.0.1:{first.port}"
    with launch_server(peer, [*ARGS, "--download-dir", str(downloads)], env={"SERVELM_API_KEY": KEY}) as second:
        name = httpx.get(f"{second.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
        assert name == "tiny-peer"  # the peer's name, so a router treats the two as one model
        expected = _complete(first.base_url, name)
        got = _complete(second.base_url, name)
        assert got["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-5)
    pulled = next(downloads.iterdir())
    for original in model.iterdir():
        assert (pulled / original.name).read_bytes() == original.read_bytes(), original.name


def test_the_model_files_need_the_key_and_honour_ranges(running):
    model, server = running
    url = f"{server.base_url}/servelm/model/"
    assert httpx.get(url + MANIFEST_NAME).status_code == 401
    headers = {"Authorization": f"Bearer {KEY}"}
    manifest = Manifest.from_json(httpx.get(url + MANIFEST_NAME, headers=headers).content)
    assert {entry.path for entry in manifest.files} == {p.name for p in model.iterdir()}
    part = httpx.get(url + "config.json", headers={**headers, "Range": "bytes=2-9"})
    assert part.status_code == 206 and part.content == (model / "config.json").read_bytes()[2:10]
    for escape in ("../etc/passwd", ".servelm-pull/journal", "nope.bin"):
        response = httpx.get(url + escape, headers=headers)
        assert response.status_code == 404 and "error" in response.json(), escape


def test_a_directory_holding_one_gguf_file_loads_it(tmp_path):
    """A peer-served or pulled GGUF model arrives as a directory with that one file."""
    (tmp_path / "model").mkdir()
    shutil.copy(default_model_path(), tmp_path / "model" / default_model_path().name)
    checkpoint = load_checkpoint(tmp_path / "model")
    assert checkpoint.source.endswith(".gguf") and checkpoint.arch.num_hidden_layers == 30
