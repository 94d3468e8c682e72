"""POST /tokenize and /detokenize against the shared tiny-model server: the ids the engine
would see, the chat template's rendering, round trips, and the error cases."""

from __future__ import annotations

import httpx


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30)


def test_tokenize_gives_the_completion_endpoints_prompt_ids(server):
    text = "The quick brown fox jumps over the lazy dog."
    result = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert result["count"] == len(result["tokens"]) > 5
    assert len(result["token_strs"]) == result["count"] and "".join(result["token_strs"]).endswith("dog.")
    # The same count the completion endpoint charges for the same prompt.
    completion = _post(server, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == result["count"]
    models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]
    assert result["max_model_len"] == models["max_model_len"]


def test_tokenize_messages_renders_the_chat_template(server):
    messages = [{"role": "user", "content": "hi there"}]
    result = _post(server, "/tokenize", {"messages": messages}).json()
    chat = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == result["count"]
    text = _post(server, "/detokenize", {"tokens": result["tokens"]}).json()["prompt"]
    assert "hi there" in text and text != "hi there"  # the template wrapped it


def test_detokenize_inverts_tokenize(server):
    text = "Ünïcödé, numbers 12345 and spaces   too"
    tokens = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert _post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == text


def test_detokenize_can_leave_special_tokens_out_as_a_stream_does(server):
    tokens = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    with_special = _post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    without = _post(server, "/detokenize", {"tokens": tokens, "skip_special_tokens": True}).json()["prompt"]
    assert "<|im_start|>" in with_special and "<|im_start|>" not in without and "hi" in without


def test_tokenize_and_detokenize_errors(server):
    cases = [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": "a", "model": "no-such-model"}, "model"),
    ]
    for path, body, param in cases:
        response = _post(server, path, body)
        assert 400 <= response.status_code < 500, (path, body, response.text)
        assert response.json()["error"]["param"] == param, (path, body, response.text)


def test_text_parts_render_joined_by_newlines_as_vllm_and_llama_cpp_join_them(server):
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]
    as_parts = _post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]}).json()
    as_text = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "first part\nsecond part"}]}).json()
    assert as_parts["tokens"] == as_text["tokens"]


def test_the_model_card_listed_and_by_id(server):
    listed = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]
    assert listed["object"] == "model" and listed["created"] > 1_700_000_000  # when the server started
    by_id = httpx.get(f"{server.base_url}/v1/models/{listed['id']}", timeout=10)
    assert by_id.status_code == 200 and by_id.json() == listed
    missing = httpx.get(f"{server.base_url}/v1/models/gpt-7", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_developer_message_renders_as_the_system_message_for_a_template_without_the_role(server):
    """As vLLM renders it: the template's default system prompt is not added in front of it."""
    def render(role: str) -> list[int]:
        messages = [{"role": role, "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}]
        return _post(server, "/tokenize", {"messages": messages}).json()["tokens"]

    assert render("developer") == render("system")
