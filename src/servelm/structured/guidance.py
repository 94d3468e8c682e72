"""The llguidance backend (PyPI `llguidance`): the default.

Chosen over xgrammar for two reasons our tenants feel (benchmarks/RESULTS.md, structured outputs):
it builds a matcher lazily (a first-seen schema costs about a millisecond before its first token,
where xgrammar compiles the whole grammar up front: seconds for a large schema), and it refuses a
JSON Schema keyword it cannot enforce instead of dropping it. Its masks are computed per token
from a lexer/parser split (tens of microseconds for a 128k vocabulary).

JSON is generated compact with Python's separators (", " and ": ") and no other whitespace: a
small model left free to add whitespace can spend its whole max_tokens on newlines.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf

if TYPE_CHECKING:  # a type of the stubs only
    from llguidance._lib import JsonCompileOptions

from servelm.sampling_params import StructuredSpec
from servelm.structured.grammars import GrammarError
from servelm.structured.regex_classes import ascii_shorthands

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}  # fmt: skip


class GuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id)) and not self._matcher.is_error()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        # What llguidance.torch.fill_next_token_bitmask does, without importing that module: its
        # import compiles a kernel with torch.compile, which loads dynamo and inductor (3 s on
        # 2 cores, paid by the first structured request of every engine process).
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    def num_acceptable(self, token_ids: list[int]) -> int:
        return int(self._matcher.validate_tokens(token_ids)) if token_ids else 0

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


class GuidanceGrammar:
    """A matcher at the grammar's start; each request's is a copy (cheap: no rebuild)."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._template.deep_copy())


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        """`tokenizer`: the model's Hugging Face fast tokenizer; `vocab_size`: the logits' width;
        `eos_token_ids`: what ends the output once the grammar is complete (default: the tokenizer's)."""
        eos = list(eos_token_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, spec: StructuredSpec) -> GuidanceGrammar:
        grammar = grammar_text(spec)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GuidanceGrammar(matcher)


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for `spec`; GrammarError where the text is not what its kind needs."""
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(json.loads(spec.text), defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_shorthands(spec.text))
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(choice_lark(json.loads(spec.text)))
        if spec.kind == "grammar":
            return llguidance.grammar_from("grammar", spec.text)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise GrammarError(f"invalid {spec.kind}: {exc}") from exc
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


def choice_lark(choices: Any) -> str:
    """A Lark grammar whose language is exactly the given strings."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a non-empty list of strings")
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)
