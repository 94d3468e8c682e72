"""Every way a request can be wrong gets a 4xx with OpenAI's error body naming the problem;
bad requests in the middle of a load never disturb the good ones."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from helpers_http import wait_idle

GOOD = {"prompt": "Hello there, how are you today?", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _post(server, path: str, body=None, content: bytes | None = None, headers=None) -> httpx.Response:
    if content is not None:  # raw bytes are still declared JSON: a body of another type is a 415
        headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{server.base_url}{path}", json=body, content=content, headers=headers, timeout=60)


def _assert_error(response: httpx.Response, status: int, param: str | None, *, code=None, says: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code, error
    assert says.lower() in error["message"].lower(), error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


def test_invalid_json_and_non_object_bodies(server):
    _assert_error(_post(server, "/v1/completions", content=b'{"prompt": "x",'), 400, None, says="invalid json")
    _assert_error(_post(server, "/v1/completions", content=b"[1, 2]"), 400, None, says="JSON object")
    _assert_error(_post(server, "/v1/chat/completions", content=b""), 400, None, says="invalid json")


# (path, body, status, param, code, words the message must contain)
CASES = [
    ("/v1/completions", {**GOOD, "max_tokenz": 4}, 400, "max_tokenz", None, "unrecognized request argument"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", None, "valid number"),
    ("/v1/completions", {**GOOD, "kv_retention": "forever"}, 400, "kv_retention", None, "'low', 'normal' or 'high'"),
    ("/v1/completions", {**GOOD, "prompt": 5}, 400, "prompt", None, "invalid value"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream", None, "boolean"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None, "missing required parameter"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages", None, "missing"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", None, "invalid value"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None, "at least 1"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature", None, "temperature must be >= 0"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p", None, "(0, 1]"),
    ("/v1/completions", {**GOOD, "top_k": -5}, 400, "top_k", None, "top_k"),
    ("/v1/completions", {**GOOD, "min_p": 2}, 400, "min_p", None, "min_p"),
    ("/v1/completions", {**GOOD, "cache_salt": ""}, 400, "cache_salt", None, "non-empty"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format", None, "needs json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type", None, "input should be"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools.0.type", None, "input should be"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice", None, "requires tools"),
    ("/v1/chat/completions", {**CHAT, "cache_salt": 7}, 400, "cache_salt", None, "valid string"),
    ("/v1/completions", {**GOOD, "presence_penalty": 3}, 400, "presence_penalty", None, "[-2, 2]"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n", None, "n must be between"),
    ("/v1/completions", {**GOOD, "n": 1000}, 400, "n", None, "n must be between"),
    ("/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens", None, ">= 0"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", None, "only with echo"),
    ("/v1/completions", {**GOOD, "min_tokens": 9}, 400, "min_tokens", None, "must not exceed max_tokens"),
    ("/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs", None, "logprobs must be in"),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": 1.0}}, 400, "logit_bias", None, "not supported"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options", None, "stream is true"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs", None, "requires logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", None, "top_logprobs must"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None, "max_completion_tokens must be at least 1"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt", None, "empty"),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt", None, "empty"),
    ("/v1/completions", {**GOOD, "prompt": [1, 2, 10_000_000]}, 400, "prompt", None, "out of range"),
    ("/v1/completions", {**GOOD, "prompt": "word " * 1500}, 400, "prompt", "context_length_exceeded", "maximum context length is 1024"),
    ("/v1/completions", {**GOOD, "prompt": "hi", "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded", "5001 tokens"),
    ("/v1/completions", {**GOOD, "prompt": "word " * 1500, "max_tokens": 5000}, 400, "prompt", "context_length_exceeded", "context length"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 5000}, 400, "max_completion_tokens", "context_length_exceeded", "context length"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f", "parameters": {}}]}, 400, "functions", None, "not supported"),
    ("/v1/chat/completions", {**CHAT, "function_call": {"name": "f"}}, 400, "function_call", None, "none"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, 400, "modalities", None, "text"),
    ("/v1/chat/completions", {**CHAT, "metadata": {"k": "v" * 600}}, 400, "metadata.k", None, "at most 512"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": []}]}, 400, "messages.0.content", None, "at least 1"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "user", "content": "now", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        ]}, 400, "messages.1.tool_calls", None, "only an assistant message"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "word " * 1500}]}, 400, "messages", "context_length_exceeded", "context length"),
    ("/v1/completions", {**GOOD, "model": "gpt-7"}, 404, "model", "model_not_found", "gpt-7"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-7"}, 404, "model", "model_not_found", "does not exist"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, status, param, code, says", CASES, ids=[f"{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_bad_request(server, path, body, status, param, code, says):
    _assert_error(_post(server, path, body), status, param, code=code, says=says)


def test_explicit_nulls_and_no_op_openai_fields_are_accepted(server):
    """Several SDKs send every optional parameter, null when unset: null takes the default."""
    nulls = {"n": None, "stream": None, "stop": None, "seed": None, "temperature": None, "top_p": None,
             "presence_penalty": None, "frequency_penalty": None, "user": None, "logit_bias": None,
             "stream_options": None}  # fmt: skip
    completion = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": None, "logprobs": None,
                                                   "echo": None, "ignore_eos": True, **nulls})  # fmt: skip
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens for completions
    chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": None, "name": None},
                     {"role": "user", "content": "hi"}],
        "max_tokens": 3, "max_completion_tokens": None, "logprobs": None, "top_logprobs": None,
        "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
        **nulls,
    })  # fmt: skip
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    # OpenAI's parameters that change nothing generated here, and a tool-using client's history
    # without calls (an assistant turn as vLLM returns it, a tool result with its id).
    chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "Hello!", "tool_calls": [], "refusal": None, "annotations": []},
                     {"role": "tool", "content": "42", "tool_call_id": "call_1"},
                     {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "again"}]}],
        "max_tokens": 3, "store": False, "metadata": {"team": "search"}, "service_tier": "auto",
        "prediction": {"type": "content", "content": "Hello"}, "modalities": ["text"], "functions": [],
        "function_call": "none",
    })  # fmt: skip
    assert chat.status_code == 200, chat.text


def test_unknown_route_and_method(server):
    _assert_error(_post(server, "/v1/embeddings", GOOD), 404, None, says="not found")
    response = httpx.get(f"{server.base_url}/v1/completions", timeout=10)
    _assert_error(response, 405, None, says="method not allowed")


def test_bad_requests_during_load_do_not_disturb_good_ones(server):
    bad_bodies = [body for path, body, *_ in CASES if path == "/v1/completions"]

    async def good(client: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = {"prompt": f"Request number {i} says hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return response.status_code, httpx.Response(200, content=lines[-2][6:]).json()["usage"]["completion_tokens"]

    async def bad(client: httpx.AsyncClient, body: dict) -> int:
        return (await client.post("/v1/completions", json=body)).status_code

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            tasks = []
            for i in range(24):
                tasks.append(asyncio.create_task(good(client, i)))
                tasks.append(asyncio.create_task(bad(client, bad_bodies[i % len(bad_bodies)])))
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert all(r == (200, 12) for r in results[0::2]), results[0::2]
    assert all(400 <= r < 500 for r in results[1::2]), results[1::2]
    wait_idle(server)
