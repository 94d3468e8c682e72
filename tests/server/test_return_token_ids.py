"""`return_token_ids` (vLLM's option) against the shared tiny-model server: the prompt's ids once,
every generated id exactly once (also those whose text is still held back), in vLLM's places for
completions and chat, streamed and not; and nothing of it without the option."""

from __future__ import annotations

import json

import httpx

PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Say something."}]


def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


NEVER_STOP = "\x00" + "never" * 60 + "\x00"


def test_completion_stream_carries_every_id_once(server):
    prompt_ids = _post(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    # A stop string that never matches makes the server hold text back (its length less one character,
    # here longer than all 24 tokens' text, so even chunks coalesced under load hold it): those ids must
    # come anyway.
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stop": [NEVER_STOP],
            "return_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = _stream(server, "/v1/completions", body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c] == [prompt_ids]
    assert "prompt_token_ids" in choices[0]
    ids = [t for c in choices for t in c["token_ids"]]
    assert len(ids) == chunks[-1]["usage"]["completion_tokens"] == 24
    assert any(c["text"] == "" and c["token_ids"] for c in choices)  # an entry there only for its ids
    text = "".join(c["text"] for c in choices)
    assert _post(server, "/detokenize", {"tokens": ids})["prompt"] == text
    whole = _post(server, "/v1/completions", {**body, "stream_options": None})["choices"][0]
    assert (whole["prompt_token_ids"], whole["token_ids"], whole["text"]) == (prompt_ids, ids, text)


def test_chat_puts_the_prompt_ids_at_the_top_level(server):
    body = {"messages": MESSAGES, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    chunks = _stream(server, "/v1/chat/completions", body)
    prompt_ids = _post(server, "/tokenize", {"messages": MESSAGES})["tokens"]
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert len(ids) == 8
    whole = _post(server, "/v1/chat/completions", body)
    assert whole["prompt_token_ids"] == prompt_ids and whole["choices"][0]["token_ids"] == ids


def test_each_choice_gets_its_prompt_ids_once(server):
    body = {"prompt": [PROMPT, "Hello"], "n": 2, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    chunks = _stream(server, "/v1/completions", body)
    firsts = {c["index"]: c["prompt_token_ids"] for chunk in chunks for c in chunk["choices"] if "prompt_token_ids" in c}
    counts = {i: sum(len(c["token_ids"]) for chunk in chunks for c in chunk["choices"] if c["index"] == i)
              for i in range(4)}  # fmt: skip
    assert sorted(firsts) == [0, 1, 2, 3] and firsts[0] == firsts[1] != firsts[2] == firsts[3]
    assert counts == {0: 4, 1: 4, 2: 4, 3: 4}


def test_without_the_option_there_are_no_ids(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    chunks = _stream(server, "/v1/completions", body)
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason", "stop_reason"} for ch in chunks
               for c in ch["choices"])  # fmt: skip
    whole = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert "prompt_token_ids" not in whole and "token_ids" not in whole["choices"][0]
