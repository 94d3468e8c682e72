"""The size bound prompt_limits.py refuses prompts by: it must never refuse a prompt that fits, so
every text must spell at most L characters per token (L: the vocabulary's longest entry)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelm.server.errors import APIError
from servelm.server.prompt_limits import PromptLimits
from servelm.tokenization.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def limits(tokenizer):
    return PromptLimits.for_tokenizer(tokenizer, max_model_len=1024)  # reads the whole vocabulary: once


# Control characters other than whitespace are left out: the tokenizer drops some of them (hypothesis
# found '\x1d' -> no token at all), so a text of them spells no token; the bound refuses a long run
# of them, which costs nobody a prompt (it would be empty).
PRINTABLE = st.characters(blacklist_categories=("Cc", "Cs"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(PRINTABLE, min_size=1, max_size=400) | st.text(alphabet=" \n\t-=#", min_size=1, max_size=2000))
def test_no_text_spells_more_than_the_longest_token_per_token(tokenizer, limits, text):
    ids = tokenizer.backend_tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
    assert len(text) <= limits.max_token_chars * len(ids)


def test_the_bound_and_what_it_says(tokenizer):
    limits = PromptLimits.for_tokenizer(tokenizer, max_model_len=1024)
    assert limits.max_token_chars == 81  # SmolLM2's longest entry: a newline and 80 spaces (no normalizer)
    limits.check_texts(["a" * limits.max_prompt_chars], "prompt")  # at the bound: the tokenizer decides
    with pytest.raises(APIError) as refused:
        limits.check_texts(["ok", "a" * (limits.max_prompt_chars + 1)], "prompt")
    error = refused.value
    assert error.status == 400 and error.param == "prompt" and error.code == "context_length_exceeded"
    assert f"below {limits.max_prompt_chars} characters" in error.message
    limits.check_messages(["hi"] * 1024)
    with pytest.raises(APIError, match="1025 messages"):
        limits.check_messages(["hi"] * 1025)
