"""Each token's own bytes, as OpenAI's chat logprobs report them (`"bytes"`).

A token decoded alone is not always text: a byte-level BPE token can hold the first two bytes of
a four-byte emoji, and decodes to U+FFFD. The `bytes` field exists so a client can join tokens
back into the text; the UTF-8 of "\ufffd" cannot. The raw bytes come from the token's vocabulary
string, by the tokenizer's own scheme:

- byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM): every byte is one printable character of
  GPT-2's byte-to-unicode table; the inverse table gives the bytes back;
- SentencePiece with byte fallback (Llama 2, Mistral): `<0xAB>` is byte 0xAB, `▁` is a space,
  the rest is UTF-8;
- anything else (or a character the table lacks): the UTF-8 of the token decoded alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's table inverted: the printable character standing for each byte → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def _decoder_types(tokenizer: Any) -> set[str]:
    """The types of the fast tokenizer's decoder (a Sequence's members too); empty when there is none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    members = (decoder.get("decoders") or []) if decoder.get("type") == "Sequence" else [decoder]
    return {str(member.get("type")) for member in members if isinstance(member, dict)}


class TokenBytes:
    """`of(ids)`: each id's raw bytes (see the module docstring); `decode_one(id)` is the fallback."""

    def __init__(self, tokenizer: Any, decode_one: Callable[[int], str]) -> None:
        self._decode_one = decode_one
        self._to_token: Callable[[int], str | None] = tokenizer.convert_ids_to_tokens
        types = _decoder_types(tokenizer)
        self._scheme = "byte-level" if "ByteLevel" in types else "byte-fallback" if "ByteFallback" in types else "text"
        self._unicode_to_byte = _gpt2_unicode_to_byte()
        self._cache: dict[int, bytes] = {}

    @property
    def scheme(self) -> str:
        return self._scheme

    def of(self, token_ids: list[int]) -> list[bytes]:
        return [self._bytes(token_id) for token_id in token_ids]

    def _bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> bytes:
        token = self._to_token(token_id) if self._scheme != "text" else None
        if token is not None and self._scheme == "byte-level":
            if all(char in self._unicode_to_byte for char in token):
                return bytes(self._unicode_to_byte[char] for char in token)
        elif token is not None and self._scheme == "byte-fallback":
            byte = _BYTE_TOKEN.fullmatch(token)
            return bytes([int(byte.group(1), 16)]) if byte else token.replace("▁", " ").encode("utf-8")
        return self._decode_one(token_id).encode("utf-8")
