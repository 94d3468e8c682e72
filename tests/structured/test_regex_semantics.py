r"""A structured-output regex means the same language under either backend: \d and \w are ASCII
(ECMAScript's, JSON Schema's and xgrammar's reading), whatever the text."""

from __future__ import annotations

import json
import re

import pytest

from servelm.sampling_params import StructuredSpec
from servelm.structured.backends import make_backend
from servelm.structured.regex_classes import ascii_shorthands
from servelm.tokenization.loading import default_model_path, load_tokenizer

# Each pattern, and the same language in Python's re with the classes spelled out (\s Unicode in both).
PATTERNS = {r"\d{3}-\d{4}": "[0-9]{3}-[0-9]{4}", r"\w+": "[0-9A-Za-z_]+", r"[\d_]+": "[0-9_]+", r"\D+": "[^0-9]+",
            r"[^\W]+": "[0-9A-Za-z_]+", r"[\Da]+": "[^0-9]+", r"\s\d": r"\s[0-9]"}  # fmt: skip
TEXTS = ["123-4567", "١٢٣-٤٥٦٧", "\U0001fbf1\U0001fbf1\U0001fbf1-1234", "abc_9", "ééé", "a-b", "__", "\u2003" + "7",
         "\u2003" + "٧"]  # fmt: skip


@pytest.mark.parametrize(
    ("pattern", "ascii"),
    [
        (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
        (r"\w\W\D", "[0-9A-Za-z_][^0-9A-Za-z_][^0-9]"),
        (r"[\d_]", "[0-9_]"),  # inside a class: the ranges
        (r"[\Da]", "[[^0-9]a]"),  # a negated one inside a class: a nested class
        (r"\\d", r"\\d"),  # an escaped backslash, then the letter d
        (r"[]\d]\d", "[]0-9][0-9]"),  # a ']' first in a class is a literal, not its end
        (r"[^]\w]", "[^]0-9A-Za-z_]"),
        (r"\p{Greek}\s\.\[\d", r"\p{Greek}\s\.\[[0-9]"),  # other escapes as written; \[ opens no class
        (r"[[:alpha:]\d]x\d", "[[:alpha:]0-9]x[0-9]"),
    ],
)
def test_shorthands_become_ascii_classes(pattern: str, ascii: str):
    assert ascii_shorthands(pattern) == ascii


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def compiler_for(backend: str, tokenizer):
    return make_backend(backend, tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def takes(grammar, tokenizer, text: str) -> bool:
    """Does the grammar take `text` whole: every token of it, then the end?"""
    tokens = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    return grammar.matcher().num_acceptable(tokens) == len(tokens)


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_both_backends_take_exactly_the_ascii_language(tokenizer, backend: str):
    compiler = compiler_for(backend, tokenizer)
    for pattern, reference in PATTERNS.items():
        grammar = compiler.compile(StructuredSpec(kind="regex", text=pattern))
        for text in TEXTS:
            assert takes(grammar, tokenizer, text) == bool(re.fullmatch(reference, text)), (backend, pattern, text)


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_a_schemas_pattern_reads_the_shorthands_the_same_way(tokenizer, backend: str):
    schema = {"type": "string", "pattern": r"^\d\w$"}
    grammar = compiler_for(backend, tokenizer).compile(StructuredSpec(kind="json", text=json.dumps(schema)))
    for text, valid in (('"1a"', True), ('"١a"', False), ('"1é"', False)):
        assert takes(grammar, tokenizer, text) is valid, (backend, text)
