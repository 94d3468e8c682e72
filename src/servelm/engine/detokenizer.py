"""Incremental detokenization and stop strings, on the API side of the engine.

Byte-level BPE tokens do not map one-to-one onto characters: a multi-byte character
may span tokens, and a token's text can depend on its neighbours (leading spaces).
So each step decodes a short window of recent tokens twice, with and without the new
ones, and emits the difference; a window that ends in U+FFFD (an unfinished UTF-8
sequence) waits for the next token.

Stop strings are searched in the text as it grows, once more than `min_tokens` tokens
exist (vLLM's rule: min_tokens holds back stop strings as the sampler holds back EOS and
stop token ids). While streaming, the last `len(longest stop) - 1` characters are held
back, because they may be the start of a stop string that the next token completes;
they are released when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Tokens of context decoded before the new ones; enough for any merge that changes spacing.
_CONTEXT_TOKENS = 6


@dataclass
class DetokenizerUpdate:
    new_text: str  # text that may be shown now
    stop_string: str | None = None  # the stop string that ended the request, if one did


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # no stop string ends the text before more tokens than this exist
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # everything decoded so far (stop strings cut off)
    emitted: int = 0  # characters of `text` already returned
    prefix_offset: int = 0  # start of the context window
    read_offset: int = 0  # first token not yet turned into text
    stopped: bool = False

    @property
    def hold_back(self) -> int:
        return max((len(s) for s in self.stop), default=1) - 1

    def add_tokens(self, new_token_ids: list[int], finished: bool = False) -> DetokenizerUpdate:
        """Append tokens; return the newly showable text, and the stop string if one matched."""
        if self.stopped:
            return DetokenizerUpdate(new_text="")
        self.token_ids.extend(new_token_ids)
        before = len(self.text)
        self.text += self._decode_new_text()
        stop_string = self._find_stop(before) if len(self.token_ids) > self.min_tokens else None
        if stop_string is not None:
            self.stopped = True
            finished = True
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold_back)
        new_text = self.text[self.emitted : end]
        self.emitted = end
        return DetokenizerUpdate(new_text=new_text, stop_string=stop_string)

    def _decode_new_text(self) -> str:
        decode = self.tokenizer.decode
        window = self.token_ids[self.prefix_offset :]
        prefix_text = decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens
        )
        full_text = decode(window, skip_special_tokens=self.skip_special_tokens)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an unfinished character, or a token that decodes to nothing yet
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        return full_text[len(prefix_text) :]

    def _find_stop(self, search_from: int) -> str | None:
        """Cut the text at the earliest stop string that ends in the new part."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = self.text.find(stop, max(0, search_from - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        if best is None:
            return None
        start, stop = best
        self.text = self.text[: start + len(stop)] if self.include_stop_str_in_output else self.text[:start]
        self.emitted = min(self.emitted, len(self.text))
        return stop
