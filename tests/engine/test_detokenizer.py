"""Incremental detokenization and stop strings with the default model's real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.tokenization.loading import load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café — 東京 🚀🚀 emoji and accents: ñ ü ß, then    spaces\nand\ttabs.",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer=tokenizer)
    pieces = [detok.add_tokens([t]).new_text for t in ids]
    pieces.append(detok.add_tokens([], finished=True).new_text)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces), "a half character was emitted"


def test_stop_string_spanning_tokens_is_cut_and_held_back(tokenizer):
    text = "alpha beta gamma STOP_HERE delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer=tokenizer, stop=["STOP_HERE"])
    shown, stop_string = [], None
    for t in ids:
        update = detok.add_tokens([t])
        shown.append(update.new_text)
        if update.stop_string:
            stop_string = update.stop_string
            break
    assert stop_string == "STOP_HERE"
    assert "".join(shown) == "alpha beta gamma "
    # Nothing of the stop string was ever shown, even partially, while it was being matched.
    assert "STOP" not in "".join(shown)
    assert detok.add_tokens(tokenizer.encode(" more", add_special_tokens=False)).new_text == ""


def test_include_stop_string_and_earliest_match(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer=tokenizer, stop=["four", "two"], include_stop_str_in_output=True)
    shown = "".join(detok.add_tokens([t]).new_text for t in ids)
    assert shown == "one two"


def test_hold_back_is_released_when_no_stop_follows(tokenizer):
    ids = tokenizer.encode("a STO b", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer=tokenizer, stop=["STOP"])
    streamed = "".join(detok.add_tokens([t]).new_text for t in ids)
    streamed += detok.add_tokens([], finished=True).new_text
    assert streamed == "a STO b"


def test_no_stop_string_ends_the_text_until_more_than_min_tokens_exist(tokenizer):
    # vLLM's rule: min_tokens holds back stop strings as it holds back EOS and stop token ids.
    ids = tokenizer.encode(" 8, 9, 10, 11, 12,", add_special_tokens=False)
    adds_comma = [i for i in range(1, len(ids) + 1)
                  if tokenizer.decode(ids[:i]).count(",") > tokenizer.decode(ids[: i - 1]).count(",")]  # fmt: skip
    for min_tokens in (0, adds_comma[0], adds_comma[0] + 1, adds_comma[1]):
        detok = IncrementalDetokenizer(tokenizer=tokenizer, stop=[","], min_tokens=min_tokens)
        shown, count = "", 0
        for t in ids:
            update = detok.add_tokens([t])
            shown += update.new_text
            count += 1
            if update.stop_string:
                break
        assert update.stop_string == ","
        assert count == next(c for c in adds_comma if c > min_tokens), min_tokens
        upto = tokenizer.decode(ids[:count])
        assert shown == upto[: upto.rindex(",")]  # the earlier commas are text like any other
