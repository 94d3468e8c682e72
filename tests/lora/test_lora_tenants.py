"""A tenant limited to its own adapters (issue 42, a tenants file's `models`), through the real server
over HTTP: a model outside its list answers exactly as a model nobody serves does (404
model_not_found, OpenAI's words, nothing about who else may use it), on every route that takes a
model; /v1/models lists only what it may use; a tenant without a list keeps everything."""

from __future__ import annotations

import httpx
import pytest

from servelm.models.hf_loader import read_hf_config
from servelm.server.launcher import launch_server
from servelm.testing.lora_adapters import write_peft_adapter
from servelm.testing.tiny_model import write_tiny_checkpoint

TENANTS = """
tenants:
  fintech: {api_keys: [k-fin], class: interactive, models: [tiny-base, fin-sql]}
  finetunes-only: {api_keys: [k-ft], class: interactive, models: [fin-sql]}
  platform: {api_keys: [k-all], class: interactive}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tenants")
    base = write_tiny_checkpoint(root / "base", "llama", seed=6, num_hidden_layers=2)
    config = read_hf_config(base)
    fin = write_peft_adapter(root / "fin", config, 8, seed=2)
    legal = write_peft_adapter(root / "legal", config, 8, seed=3)
    tenants = root / "tenants.yaml"
    tenants.write_text(TENANTS)
    process = launch_server(base, ["--enable-lora", "--lora-modules", f"fin-sql={fin}", f"legal={legal}",
                                   "--max-loras", "2", "--num-blocks", "128", "--num-threads", "1",
                                   "--served-model-name", "tiny-base", "--tenants", str(tenants)])  # fmt: skip
    yield process
    assert process.stop() == 0, process.log_tail()


def _complete(server, key: str, model: str | None) -> httpx.Response:
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0} | ({"model": model} if model else {})
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)  # fmt: skip


def _models(server, key: str) -> set[str]:
    response = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return {card["id"] for card in response.json()["data"]}


def _not_found(response: httpx.Response, model: str) -> None:
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["message"] == f"The model `{model}` does not exist or you do not have access to it."


def test_a_tenant_uses_only_its_models_and_others_answer_as_if_absent(server) -> None:
    assert _complete(server, "k-fin", "fin-sql").status_code == 200
    assert _complete(server, "k-fin", "tiny-base").status_code == 200
    assert _complete(server, "k-fin", None).status_code == 200  # no model: the base, which it may use
    _not_found(_complete(server, "k-fin", "legal"), "legal")
    _not_found(_complete(server, "k-fin", "nobody-serves-this"), "nobody-serves-this")
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", headers={"Authorization": "Bearer k-fin"},
                      json={"model": "legal", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
    _not_found(chat, "legal")
    tokenized = httpx.post(f"{server.base_url}/tokenize", headers={"Authorization": "Bearer k-fin"},
                           json={"model": "legal", "prompt": "hi"})  # fmt: skip
    _not_found(tokenized, "legal")
    card = httpx.get(f"{server.base_url}/v1/models/legal", headers={"Authorization": "Bearer k-fin"})
    _not_found(card, "legal")


def test_a_tenant_limited_to_its_finetunes_cannot_use_the_base(server) -> None:
    assert _complete(server, "k-ft", "fin-sql").status_code == 200
    _not_found(_complete(server, "k-ft", "tiny-base"), "tiny-base")
    _not_found(_complete(server, "k-ft", None), "tiny-base")
    assert _models(server, "k-ft") == {"fin-sql"}


def test_models_lists_what_the_caller_may_use(server) -> None:
    assert _models(server, "k-fin") == {"tiny-base", "fin-sql"}
    assert _models(server, "k-all") == {"tiny-base", "fin-sql", "legal"}
    assert _complete(server, "k-all", "legal").status_code == 200
