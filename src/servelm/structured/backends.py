"""--structured-outputs-backend: which grammar library enforces structured outputs."""

from __future__ import annotations

from typing import Any

from servelm.structured.grammars import GrammarBackend

BACKENDS = ("auto", "guidance", "xgrammar")


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> GrammarBackend:
    """The backend `name` names ("auto": guidance, guidance.py says why) over the model's tokenizer."""
    if name in ("auto", "guidance"):
        from servelm.structured.guidance import GuidanceBackend  # each library loads only when chosen

        return GuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "xgrammar":
        from servelm.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"unknown structured outputs backend {name!r}; choose one of {', '.join(BACKENDS)}")
