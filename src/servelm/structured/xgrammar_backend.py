"""The xgrammar backend (PyPI `xgrammar`), chosen with --structured-outputs-backend xgrammar.

It compiles a grammar's token masks up front (the first request with a large new schema waits
for that, on the compile thread, never the step loop), then its per-token masks are the fastest
we measured. JSON is compact with Python's separators, as with the default backend (guidance.py).
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar

from servelm.sampling_params import StructuredSpec
from servelm.structured.grammars import GrammarError
from servelm.structured.guidance import choice_lark


class XGrammarMatcher:
    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def num_acceptable(self, token_ids: list[int]) -> int:
        accepted = 0
        for token_id in token_ids:  # xgrammar has no look-ahead check: accept, count, roll back
            if not self._matcher.accept_token(token_id):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


class XGrammarGrammar:
    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self._compiled = compiled

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(self._compiled))


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
        )
        self._compiler = xgrammar.GrammarCompiler(info)

    def compile(self, spec: StructuredSpec) -> XGrammarGrammar:
        compiler = self._compiler
        try:
            if spec.kind == "json":
                compiled = compiler.compile_json_schema(spec.text, any_whitespace=False, separators=(", ", ": "))
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.text)
            elif spec.kind == "choice":
                compiled = compiler.compile_lark(choice_lark(json.loads(spec.text)))
            elif spec.kind == "grammar":
                compiled = compiler.compile_grammar(spec.text)
            else:
                raise GrammarError(f"unknown structured output kind {spec.kind!r}")
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {spec.kind}: {exc}") from exc
        return XGrammarGrammar(compiled)
