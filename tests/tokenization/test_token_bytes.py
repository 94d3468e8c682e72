"""Each token's raw bytes (chat logprobs' `bytes`): joined over a text's tokens they are the text's
UTF-8, even where a token holds only part of a character, for the byte-level BPE of the default
model and a SentencePiece-style tokenizer with byte fallback."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from servelm.tokenization.loading import load_tokenizer
from servelm.tokenization.token_bytes import TokenBytes

TEXTS = ["👩🏽‍💻 emoji, 東京, naïve café", "<|im_start|>user\nplain ascii<|im_end|>", "\t tabs  and\r\nnewlines"]


def _token_bytes(tokenizer) -> TokenBytes:
    return TokenBytes(tokenizer, lambda i: tokenizer.decode([i], skip_special_tokens=False))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_join_into_the_texts_utf8_where_decoding_alone_gives_replacement_chars(text):
    tokenizer = load_tokenizer(None)
    token_bytes = _token_bytes(tokenizer)
    assert token_bytes.scheme == "byte-level"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes.of(ids)) == text.encode("utf-8")
    if "👩" in text:  # the case the field exists for: a token that is part of a character
        alone = [tokenizer.decode([i]) for i in ids]
        assert any("\ufffd" in piece for piece in alone)


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's scheme in miniature: pieces with ▁ for spaces, <0xAB> tokens for every byte."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁hello": 257, "▁w": 258, "orld": 259}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_byte_fallback_tokens_are_their_byte_or_their_piece_with_spaces():
    tokenizer = _byte_fallback_tokenizer()
    token_bytes = _token_bytes(tokenizer)
    assert token_bytes.scheme == "byte-fallback"
    emoji = "🚀".encode()
    ids = [257, 258, 259, *(1 + b for b in emoji)]
    assert token_bytes.of(ids) == [b" hello", b" w", b"orld", *(bytes([b]) for b in emoji)]
    assert tokenizer.decode(ids) == "hello world🚀"  # what the bytes join to, less the leading space the decoder strips


def test_a_tokenizer_of_neither_scheme_gives_each_tokens_decoded_text():
    backend = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    token_bytes = _token_bytes(tokenizer)
    assert token_bytes.scheme == "text" and token_bytes.of([1]) == [b"hello"]
