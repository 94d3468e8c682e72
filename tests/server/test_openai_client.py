"""The official openai client against a live `servelm serve`: completions and chat, streaming and not,
n > 1, logprobs, stop strings, seeds, echo scoring (lm-eval's loglikelihood call)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from helpers_http import metric_value, scrape, wait_idle

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest"
MESSAGES = [{"role": "user", "content": "Say something about foxes."}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    [card] = client.models.list().data
    return card.id


def test_completion_stream_equals_non_stream(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, **GREEDY)
    [choice] = whole.choices
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 10
    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    # The streamed request repeated the prompt: its full blocks came from the prefix cache.
    assert whole.usage.prompt_tokens_details.cached_tokens % 16 == 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 16 * 16


def test_chat_stream_equals_non_stream(client, model):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10, **GREEDY)
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert whole.usage.completion_tokens == 10
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=10, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_choices_share_the_prompt_blocks(client, model, server):
    wait_idle(server)
    hits_before = metric_value(scrape(server), "servelm:prefix_cache_hits_total")
    long_prompt = PROMPT + " " + PROMPT  # > 2 full blocks of 16 tokens
    result = client.completions.create(
        model=model, prompt=long_prompt, max_tokens=6, n=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 18
    assert len({c.text for c in result.choices}) > 1, "n choices with one seed must still differ"
    hits_after = metric_value(wait_idle(server), "servelm:prefix_cache_hits_total")
    # Two siblings each find the first choice's full prompt blocks in the prefix cache.
    assert hits_after - hits_before >= 2 * 32
    again = client.completions.create(
        model=model, prompt=long_prompt, max_tokens=6, n=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in again.choices] == [c.text for c in result.choices]


def test_n4_seeded_choices_differ_repeat_and_share_blocks(client, model, server):
    """n=4 with a seed at the default token budget: four different samples, the same four for the
    same seed, and each of the three siblings served the prompt's full blocks by the prefix cache."""
    prompt = "A fresh prompt for the n=4 test, long enough to fill a few KV blocks of sixteen tokens each. " * 3
    wait_idle(server)
    hits_before = metric_value(scrape(server), "servelm:prefix_cache_hits_total")
    request = dict(model=model, prompt=prompt, max_tokens=8, n=4, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    result = client.completions.create(**request)
    hits = metric_value(wait_idle(server), "servelm:prefix_cache_hits_total") - hits_before
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 4, texts
    full_block_tokens = (result.usage.prompt_tokens - 1) // 16 * 16  # the last prompt token is never served cached
    assert full_block_tokens >= 32
    assert hits == 3 * full_block_tokens
    again = client.completions.create(**request)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts


def test_chat_n_streaming(client, model):
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, n=2, max_tokens=5, stream=True, temperature=0.8, seed=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"} and all(texts.values())


def test_seed_makes_sampling_repeatable(client, model):
    def sample(seed: int) -> str:
        return client.completions.create(
            model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
        ).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_completion_logprobs(client, model):
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == result.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert 3 <= len(top) <= 4 and chosen <= 0.0
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-4), "greedy picks the most likely token"
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client, model):
    result = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    assert bytes(b for entry in content for b in entry.bytes).decode() == result.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        if "\ufffd" not in entry.token:  # a whole-character token: its bytes are its text's
            assert entry.bytes == list(entry.token.encode())
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-4)


def test_the_model_card_and_the_system_fingerprint_field(client, model, server):
    assert client.models.retrieve(model).id == model
    raw = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
    assert "system_fingerprint" in raw.json()  # null, as vLLM sends it; OpenAI's clients read it


def test_echo_scores_the_prompt_like_lm_eval(client, model, server):
    """lm-eval's loglikelihood: token-id prompts in a batch, echo, logprobs=1, max_tokens 1 or 0."""
    ids = [[504, 2365, 6354, 16438, 27003, 690, 260, 23790], [504, 2365, 6354]]
    for max_tokens in (1, 0):
        result = client.completions.create(
            model=model, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0.0
        )
        for choice, prompt in zip(sorted(result.choices, key=lambda c: c.index), ids):
            logprobs = choice.logprobs
            assert len(logprobs.tokens) == len(prompt) + max_tokens
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            assert all(lp is not None and lp < 0 for lp in logprobs.token_logprobs[1:])
        assert result.usage.prompt_tokens == sum(len(p) for p in ids)
        assert result.usage.completion_tokens == 2 * max_tokens
    # Raw body as lm-eval posts it, and the numbers are the same run to run.
    body = {"model": model, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234}
    first = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    second = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    first_lps, second_lps = (r["choices"][0]["logprobs"]["token_logprobs"] for r in (first, second))
    assert first_lps[0] is None and second_lps[0] is None
    assert first_lps[1:] == pytest.approx(second_lps[1:], abs=1e-4)  # batch composition moves the last bits


def test_stop_strings(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    expected = full[: full.index(stop)]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY)
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, stop=stop, stream=True, **GREEDY)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == expected and chunks[-1].finish_reason == "stop"


def test_prompt_forms_and_token_ids(client, model):
    result = client.completions.create(model=model, prompt=["Hello there", "General Kenobi"], max_tokens=3, **GREEDY)
    assert sorted(c.index for c in result.choices) == [0, 1]
    single = client.completions.create(model=model, prompt="General Kenobi", max_tokens=3, **GREEDY)
    assert result.choices[1].text == single.choices[0].text
    ids = client.completions.create(model=model, prompt=[[504, 2365, 6354]], max_tokens=3, **GREEDY)
    assert ids.usage.prompt_tokens == 3


def test_cache_salt_keeps_prefix_caches_apart(client, model, server):
    """Same prompt, other salt: no prefix hit (another tenant's KV is not reused); same salt: hits."""
    prompt = "salted tenant prompt " + PROMPT + " " + PROMPT  # > 2 full blocks, unseen by other tests

    def hits_for(salt: str | None) -> float:
        wait_idle(server)
        before = metric_value(scrape(server), "servelm:prefix_cache_hits_total")
        extra = {"ignore_eos": True, **({"cache_salt": salt} if salt is not None else {})}
        first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
        assert first.choices[0].text
        hits = metric_value(wait_idle(server), "servelm:prefix_cache_hits_total") - before
        # The response says the same as the server's counter (OpenAI's usage field).
        assert first.usage.prompt_tokens_details.cached_tokens == hits
        return hits

    assert hits_for("tenant-a") == 0  # first time in tenant a's namespace
    assert hits_for("tenant-b") == 0  # the same tokens, another namespace
    assert hits_for(None) == 0  # unsalted is a namespace of its own
    assert hits_for("tenant-a") >= 32  # tenant a's own blocks are reused
