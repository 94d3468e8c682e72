"""LoRA through the real server over HTTP (issue 42): `servelm serve --enable-lora --lora-modules`
lists its adapters under /v1/models with their parent; a request's `model` picks the adapter and
gets its merged-weight reference's greedy tokens, the base model's name the base model's; a name
nobody serves is a 404 model_not_found in OpenAI's shape."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from servelm.models.hf_loader import read_hf_config
from servelm.server.launcher import launch_server
from servelm.testing.lora_adapters import merge_into, write_peft_adapter
from servelm.testing.tiny_model import write_tiny_checkpoint

PROMPT = [1500, 2600, 3700, 4800, 5900, 7000, 8100]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-http")
    base = write_tiny_checkpoint(root / "base", "llama", seed=6, num_hidden_layers=2)
    adapter = write_peft_adapter(root / "sql", read_hf_config(base), 16, seed=2)
    as_json = json.dumps({"name": "sql-v2", "path": str(adapter), "base_model_name": "tiny-base"})
    modules = [f"sql={adapter}", as_json]
    process = launch_server(base, ["--enable-lora", "--lora-modules", *modules, "--max-loras", "2", "--num-blocks",
                                   "256", "--num-threads", "1", "--served-model-name", "tiny-base"])  # fmt: skip
    yield process, base, adapter
    assert process.stop() == 0, process.log_tail()


def _reference(base, adapter=None) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        merge_into(model, adapter)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def _tokens(server, model: str) -> list[int]:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                          json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_models_lists_each_adapter_with_its_parent(lora_server) -> None:
    server, _, adapter = lora_server
    cards = {card["id"]: card for card in httpx.get(f"{server.base_url}/v1/models").json()["data"]}
    assert set(cards) == {"tiny-base", "sql", "sql-v2"}
    assert cards["sql"]["parent"] == "tiny-base" and cards["sql"]["root"] == str(adapter)
    assert cards["sql-v2"]["parent"] == "tiny-base" and cards["tiny-base"]["parent"] is None
    assert httpx.get(f"{server.base_url}/v1/models/sql").json()["id"] == "sql"


def test_the_requests_model_picks_the_adapter(lora_server) -> None:
    server, base, adapter = lora_server
    with_adapter = _reference(base, adapter)
    assert _tokens(server, "sql") == with_adapter
    assert _tokens(server, "sql-v2") == with_adapter
    assert _tokens(server, "tiny-base") == _reference(base) != with_adapter


def test_an_unknown_model_is_a_404_model_not_found(lora_server) -> None:
    server, _, _ = lora_server
    response = httpx.post(f"{server.base_url}/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "nope" in error["message"]


def test_run_time_loading_is_off_without_its_flag(lora_server) -> None:
    server, _, adapter = lora_server
    response = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapter)})
    assert response.status_code == 404 and "--allow-runtime-lora-updating" in response.json()["error"]["message"]
