"""Prompts refused by their size alone, before anything tokenizes or renders them.

Tokenizing costs time and memory in proportion to the text (~0.3 s and ~40 bytes per token for
1 MB here, on one of the few tokenizer threads every request shares), so a prompt that cannot
fit the context must be refused without it. A text's length bounds its token count from below:

    tokens(text) >= len(text) / L     L = the vocabulary's longest entry, in characters

because every token spells at most L characters of the text (byte-level BPE writes one character
per byte, so an entry is never shorter than the text it decodes to; a special token such as
`<|im_start|>` is an entry too). A text longer than max_model_len x L therefore never fits, and
no text that could fit is refused: the check is exact in that direction, only loose in the
other (the tokenizer's count, checked after encoding, stays the precise one). A tokenizer with
a normalizer may shorten the text first (NFKC composing characters, whitespace collapsed), so
there the bound gets a margin of NORMALIZER_MARGIN.

Chat: the message contents are bounded the same way (the template only adds to them), and a
conversation may have at most max_model_len messages (a template spends at least one token
on each message's role marker). Token-id prompts need no estimate: their length is exact
(serving.check_prompts rejects them before any copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servelm.server.errors import APIError

NORMALIZER_MARGIN = 4


@dataclass(frozen=True)
class PromptLimits:
    max_model_len: int
    max_token_chars: int  # L: no token spells more characters of a (normalized) text

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int) -> PromptLimits:
        """L from a Hugging Face tokenizer's vocabulary (added tokens included), with the margin
        when it normalizes text (or is a slow one, whose normalization is not inspectable)."""
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        normalizes = backend is None or backend.normalizer is not None
        return cls(max_model_len, max(longest, 1) * (NORMALIZER_MARGIN if normalizes else 1))

    @property
    def max_prompt_chars(self) -> int:
        """Any longer text holds more than max_model_len tokens."""
        return self.max_model_len * self.max_token_chars

    def check_texts(self, texts: list[str], param: str) -> None:
        """400 for a text prompt that cannot fit, whatever its tokens turn out to be."""
        longest = max(map(len, texts), default=0)
        if longest > self.max_prompt_chars:
            raise self._too_long(f"the prompt has {longest} characters", param)

    def check_messages(self, contents: list[str], param: str = "messages") -> None:
        """400 for a conversation that cannot fit: too many messages, or too much text in them."""
        if len(contents) > self.max_model_len:
            raise self._too_long(f"the conversation has {len(contents)} messages, each taking at least one token",
                                 param)  # fmt: skip
        total = sum(map(len, contents))
        if total > self.max_prompt_chars:
            raise self._too_long(f"the messages have {total} characters", param)

    def _too_long(self, what: str, param: str) -> APIError:
        return APIError(
            400,
            f"This model's maximum context length is {self.max_model_len} tokens, but {what}: more than "
            f"{self.max_model_len} tokens whatever the text (this tokenizer's tokens span at most "
            f"{self.max_token_chars} characters, so a prompt fits only below {self.max_prompt_chars} characters). "
            "Please reduce the length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )
