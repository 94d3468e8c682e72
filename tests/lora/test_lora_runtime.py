"""LoRA adapters loaded and unloaded at run time through the real server (issue 42), as vLLM names
the routes: POST /v1/load_lora_adapter serves a PEFT directory under a name (its tokens then those
of its merged-weight reference, /v1/models listing it), refusing with a 400 that says why an
adapter that cannot be served; POST /v1/unload_lora_adapter stops serving it (404 for it after)
while a stream already using it runs to its end. Both answer only behind their flag and the API key.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from servelm.models.hf_loader import read_hf_config
from servelm.server.launcher import launch_server
from servelm.testing.lora_adapters import merge_into, write_peft_adapter
from servelm.testing.tiny_model import write_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from helpers_http import child_pids

PROMPT = [1500, 2600, 3700, 4800, 5900, 7000, 8100]
KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def runtime_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runtime")
    base = write_tiny_checkpoint(root / "base", "llama", seed=6, num_hidden_layers=2)
    arch = read_hf_config(base)
    adapters = {"a": write_peft_adapter(root / "a", arch, 8, seed=3), "b": write_peft_adapter(root / "b", arch, 16, seed=4),
                "too-big": write_peft_adapter(root / "too-big", arch, 32, seed=5)}  # fmt: skip
    process = launch_server(base, ["--enable-lora", "--allow-runtime-lora-updating", "--max-lora-rank", "16",
                                   "--num-blocks", "256", "--num-threads", "1", "--served-model-name", "tiny-base",
                                   "--api-key", KEY])  # fmt: skip
    yield process, base, adapters
    assert process.stop() == 0, process.log_tail()


def _post(server, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def _tokens(server, model: str, max_tokens: int = 8) -> httpx.Response:
    return _post(server, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                             "temperature": 0, "ignore_eos": True, "return_token_ids": True})  # fmt: skip


def _reference(base, adapter) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    merge_into(model, adapter)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def test_a_loaded_adapter_serves_its_tokens_and_is_listed(runtime_server) -> None:
    server, base, adapters = runtime_server
    assert _tokens(server, "a").status_code == 404  # not loaded yet
    load = _post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])})
    assert load.status_code == 200 and "'a'" in load.text, load.text
    response = _tokens(server, "a")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == _reference(base, adapters["a"])
    cards = {c["id"]: c for c in httpx.get(f"{server.base_url}/v1/models", headers=AUTH).json()["data"]}
    assert cards["a"]["parent"] == "tiny-base" and cards["a"]["root"] == str(adapters["a"])


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"lora_name": "big", "lora_path": "{too-big}"}, 400, "over --max-lora-rank 16"),
        ({"lora_name": "nowhere", "lora_path": "/no/such/adapter"}, 400, "not a PEFT LoRA adapter"),
        ({"lora_name": "tiny-base", "lora_path": "{a}"}, 400, "base model's name"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ],
)
def test_an_adapter_that_cannot_be_served_is_a_400_saying_why(runtime_server, body, status, says) -> None:
    server, _, adapters = runtime_server
    body = {k: v.format(**{n: str(p) for n, p in adapters.items()}) for k, v in body.items()}
    response = _post(server, "/v1/load_lora_adapter", body)
    assert response.status_code == status, response.text
    assert says in response.json()["error"]["message"]
    assert _tokens(server, body["lora_name"]).status_code in (404, 200 if body["lora_name"] == "tiny-base" else 404)


def test_a_name_already_loaded_is_refused(runtime_server) -> None:
    server, _, adapters = runtime_server
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "dup", "lora_path": str(adapters["b"])}).status_code == 200
    again = _post(server, "/v1/load_lora_adapter", {"lora_name": "dup", "lora_path": str(adapters["a"])})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]


def test_unloading_lets_a_stream_in_flight_finish_and_refuses_new_requests(runtime_server) -> None:
    server, base, adapters = runtime_server
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])}).status_code == 200
    expected = _tokens(server, "b", max_tokens=300).json()["choices"][0]["token_ids"]
    first_chunk = threading.Event()
    streamed: list[int] = []
    finish: list[str | None] = []

    def stream() -> None:
        body = {"model": "b", "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}  # fmt: skip
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    streamed.extend(choice.get("token_ids") or [])
                    finish.append(choice.get("finish_reason"))
                    first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(60)
    unload = _post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert unload.status_code == 200, unload.text
    assert not finish or finish[-1] is None  # the stream was still running when its adapter went
    assert _tokens(server, "b").status_code == 404  # new requests: no such model
    reader.join(120)
    assert streamed == expected and finish[-1] == "length"
    missing = _post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    # Loaded again under the same name, from another directory: its own tokens, not the old slot's.
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["a"])}).status_code == 200
    assert _tokens(server, "b").json()["choices"][0]["token_ids"] == _reference(base, adapters["a"])


def test_the_routes_need_the_api_key(runtime_server) -> None:
    server, _, adapters = runtime_server
    response = _post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["a"])}, headers=None)
    assert response.status_code == 401


def test_a_restarted_core_serves_the_adapters_loaded_at_run_time(runtime_server) -> None:
    """kill -9 of the engine core: the supervisor restarts it with the adapters served at that
    moment (a run-time load kept, a run-time unload not undone), the same tokens as before."""
    server, base, adapters = runtime_server
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "kept", "lora_path": str(adapters["a"])}).status_code == 200
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(adapters["b"])}).status_code == 200
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "gone"}).status_code == 200
    [core] = child_pids(server.process.pid, "spawn_main")
    os.kill(core, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while child_pids(server.process.pid, "spawn_main") in ([], [core]) or httpx.get(f"{server.base_url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "the core was not restarted"
        time.sleep(0.2)
    response = _tokens(server, "kept")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == _reference(base, adapters["a"])
    assert _tokens(server, "gone").status_code == 404
