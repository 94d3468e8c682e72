"""Llama 3's real tokenizer (128,256 tokens, tiktoken BPE), offline: a second model family for tests
and benchmarks, with a vocabulary 2.6x the default model's.

There is no model hub here, but Meta's own `llama-models` package (PyPI) ships Llama 3's
`tokenizer.model`: 128,000 byte-level BPE ranks in tiktoken's format, to which Meta's code adds 256
special tokens (`<|begin_of_text|>` = 128000, ..., `<|eot_id|>` = 128009). This module rebuilds the
Hugging Face tokenizer from that file the way Hugging Face's own conversion does (transformers'
`TikTokenConverter`: the ranks as a BPE vocabulary, merges derived from them, Meta's split
pattern, byte-level decoding), adds the special tokens with Meta's ids, a BOS on every encode and
Llama 3 Instruct's chat template. tests/structured/test_llama3_family.py checks it encodes
exactly as Meta's tiktoken encoding does.

    llama3_tokenizer()                      -> a PreTrainedTokenizerFast
    write_llama3_tiny_checkpoint(dir, ...)  -> a tiny random Llama with that tokenizer (vocab 128,256)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import transformers
from tokenizers import AddedToken, processors
from transformers.convert_slow_tokenizer import TikTokenConverter

from servelm.testing.tiny_model import write_tiny_checkpoint

# Meta's split pattern (llama_models/llama3/tokenizer.py) and special tokens, in id order after the
# 128,000 ranks: eleven named ones, one more reserved each for what later versions name, and the
# rest reserved up to 256.
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_NAMED = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
          "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
          "<|eot_id|>", "<|python_tag|>", "<|image|>")  # fmt: skip
NUM_SPECIAL_TOKENS = 256
SPECIAL_TOKENS = (*_NAMED, *(f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL_TOKENS - len(_NAMED))))
BOS, EOT, EOS = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"

# Llama 3 Instruct's chat template (its tokenizer_config.json), tools left out: a header per message,
# the content trimmed, <|eot_id|> after each; BOS first.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


class Llama3Unavailable(RuntimeError):
    """The `llama-models` package (which carries the tokenizer file) is not installed."""


def llama3_tokenizer_file() -> Path:
    """Meta's tokenizer.model inside the installed llama-models package (found without importing it)."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None or not spec.submodule_search_locations:
        raise Llama3Unavailable("Llama 3's tokenizer comes from the llama-models package: pip install llama-models")
    path = Path(next(iter(spec.submodule_search_locations))) / "llama3" / "tokenizer.model"
    if not path.is_file():
        raise Llama3Unavailable(f"no Llama 3 tokenizer in the llama-models package at {path}")
    return path


def llama3_tokenizer() -> Any:
    """Llama 3's tokenizer as Hugging Face's fast tokenizer (module doc): BOS added on encode, EOT ends a turn."""
    backend = TikTokenConverter(vocab_file=str(llama3_tokenizer_file()), pattern=PATTERN).converted()
    num_ranks = backend.get_vocab_size()
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in SPECIAL_TOKENS])
    bos_id = backend.token_to_id(BOS)
    if bos_id != num_ranks:  # Meta's ids: the specials follow the ranks, in order
        raise AssertionError(f"{BOS} got id {bos_id}, expected {num_ranks}")
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]),
    ])  # fmt: skip
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOT, chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def write_llama3_tiny_checkpoint(directory: str | Path, seed: int = 0, tokenizer: Any = None, **overrides: Any) -> Path:
    """A tiny random Llama (tiny_model's shape) with Llama 3's tokenizer and vocabulary; `tokenizer`
    reuses one already built (llama3_tokenizer takes a few seconds). Generation stops at EOT or EOS."""
    tokenizer = tokenizer if tokenizer is not None else llama3_tokenizer()
    eos_ids = [tokenizer.convert_tokens_to_ids(EOT), tokenizer.convert_tokens_to_ids(EOS)]
    return write_tiny_checkpoint(directory, seed=seed, tokenizer=tokenizer,
                                 **{"eos_token_id": eos_ids, **overrides})  # fmt: skip
