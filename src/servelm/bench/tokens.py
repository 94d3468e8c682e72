"""Prompt text with an exact token count for the target tokenizer.

Text is built from token ids, never the other way round: we sample ids from a vocabulary of
"clean words" (tokens whose text is a space followed by a few lowercase letters, and that
encode back to themselves), and send `decode(ids)`. Every such token starts with a space, so
a byte-level BPE (GPT-2, Llama 3, SmolLM) or SentencePiece pre-tokenizer splits the text at
exactly the token boundaries, and

    encode(decode(ids)) == ids            (plus the tokenizer's own BOS, if it adds one)

holds for any sequence of them. That is what makes counts exact and shared prefixes shared
token for token: a prompt is `decode(prefix_ids + rest_ids)`, and the server tokenizes it
back into `prefix_ids + rest_ids`. `exact_text` checks the round trip on every prompt anyway,
so a tokenizer where the argument fails is an error, not a silently wrong benchmark.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_WORD = re.compile(r" [a-z]{3,12}")
_ANCHOR = "x"  # decoded before each candidate, so a SentencePiece decoder keeps the leading space
_MIN_WORDS = 1000


class TokenizationError(RuntimeError):
    """The tokenizer does not round-trip generated text exactly (see module doc)."""


class TokenSource:
    """Samples clean-word token ids, turns them into text, and counts tokens like the server does."""

    def __init__(self, tokenizer: Any, name: str = "") -> None:
        self.tokenizer = tokenizer
        self.name = name  # where the tokenizer came from, for the report
        self.word_ids = _clean_word_ids(tokenizer)
        if len(self.word_ids) < _MIN_WORDS:
            raise TokenizationError(
                f"only {len(self.word_ids)} clean word tokens in this tokenizer (need {_MIN_WORDS}): "
                "cannot build prompts with exact token counts"
            )
        # Tokens the server adds around a prompt it encodes (a BOS, usually): part of its count.
        probe = " hello world"
        self.num_special_tokens = len(self.encode(probe)) - len(self.encode(probe, add_special_tokens=False))

    def sample(self, rng: random.Random, num_tokens: int) -> list[int]:
        return [rng.choice(self.word_ids) for _ in range(max(num_tokens, 0))]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids as an OpenAI-compatible server encodes a completions prompt (special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def count(self, text: str, add_special_tokens: bool = False) -> int:
        return len(self.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def exact_text(self, token_ids: list[int]) -> str:
        """`decode(token_ids)`, checked to encode back to exactly `token_ids` (see module doc)."""
        text = self.decode(token_ids)
        back = self.encode(text, add_special_tokens=False)
        if back != token_ids:
            first = next((i for i, (a, b) in enumerate(zip(back, token_ids)) if a != b), min(len(back), len(token_ids)))
            raise TokenizationError(
                f"text of {len(token_ids)} tokens encodes back to {len(back)} tokens, first difference at {first}"
            )
        return text


def _clean_word_ids(tokenizer: Any) -> list[int]:
    """Ids whose text is ' ' + 3-12 lowercase letters and that encode back to that one id."""
    anchor_ids = list(tokenizer.encode(_ANCHOR, add_special_tokens=False))
    anchor_text = tokenizer.decode(anchor_ids, skip_special_tokens=False)
    vocab_size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pairs = [anchor_ids + [i] for i in range(vocab_size)]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust decoder: 5x faster, same text without cleanup
    if backend is not None:
        texts = backend.decode_batch(pairs, skip_special_tokens=False)
    else:
        texts = tokenizer.batch_decode(pairs, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    candidates = {
        i: text[len(anchor_text) :]
        for i, text in enumerate(texts)
        if i not in special and text.startswith(anchor_text) and _WORD.fullmatch(text[len(anchor_text) :])
    }
    words = list(candidates.values())
    if backend is not None and hasattr(backend, "encode_batch_fast"):  # no offsets: 3x faster
        encoded = [e.ids for e in backend.encode_batch_fast(words, add_special_tokens=False)]
    else:
        encoded = tokenizer(words, add_special_tokens=False)["input_ids"] if words else []
    return sorted(i for (i, _), ids in zip(candidates.items(), encoded) if list(ids) == [i])


def load_token_source(path: str | Path | None) -> TokenSource:
    """A tokenizer from a Hugging Face directory or a .gguf file; None: servelm's default model."""
    from servelm.tokenization.loading import (
        load_tokenizer,  # imports transformers: only when a tokenizer is needed
    )

    tokenizer = load_tokenizer(path)
    return TokenSource(tokenizer, name=str(path) if path is not None else "servelm default model")


def resolve_token_source(explicit: str | None, model_id: str | None, model_root: str | None) -> TokenSource:
    """--tokenizer if given; else the server's model id (or root) as a local path; else, when the
    server serves servelm's embedded default model, that model's tokenizer."""
    if explicit:
        return load_token_source(explicit)
    for candidate in (model_id, model_root):
        if candidate and Path(candidate).expanduser().exists():
            return load_token_source(candidate)
    from servelm.default_model import DEFAULT_MODEL_FILE

    if model_id and DEFAULT_MODEL_FILE.startswith(model_id):
        logger.info("model %r is servelm's embedded default: using its tokenizer", model_id)
        return load_token_source(None)
    raise TokenizationError(
        f"cannot find a tokenizer for model {model_id!r}: pass --tokenizer PATH (a Hugging Face directory or a .gguf)"
    )
