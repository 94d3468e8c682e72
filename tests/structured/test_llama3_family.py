"""A second model family for structured outputs: Llama 3's real tokenizer (128,256 tokens, a tiktoken
BPE with another split pattern and specials than SmolLM2's) on a tiny random Llama. The tokenizer
must encode exactly as Meta's own encoding does, and every constrained output must still parse
and validate, at temperature 1.0 over random logits (only the mask keeps it in the schema)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from servelm.engine.llm import LLM
from servelm.sampling_params import SamplingParams, StructuredSpec
from servelm.testing.llama3_tokenizer import (
    PATTERN,
    SPECIAL_TOKENS,
    llama3_tokenizer,
    llama3_tokenizer_file,
    write_llama3_tiny_checkpoint,
)

TEXTS = [
    "Hello world!",
    "  leading spaces\n\nand   newlines\t\ttabs \n",
    '{"name": "Ada", "age": 36, "tags": ["x", "y"], "ok": true, "n": null}',
    "naïve café — 日本語のテキスト 🤖 1234567 3.14159",
    "def f(x):\n    return x**2  # it's what we'd've done\n",
    "<|eot_id|> is special only where the caller says so",
]
SCHEMAS = {
    "tool without parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    "nested form": {
        "type": "object",
        "properties": {
            "slot": {"type": "object", "properties": {"day": {"enum": ["mon", "tue", "wed"]},
                                                      "hour": {"type": "integer", "minimum": 8, "maximum": 18}},
                     "required": ["day", "hour"], "additionalProperties": False},
            "note": {"type": ["string", "null"], "maxLength": 12},
        },
        "required": ["slot", "note"], "additionalProperties": False,
    },
    "array of objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                                   "qty": {"type": "integer", "minimum": 0, "maximum": 5}},
                  "required": ["sku", "qty"], "additionalProperties": False},
    },
}  # fmt: skip
# Bounded everywhere on purpose: over random logits a free-length number or string rarely ends (any of
# ~1,100 digit tokens continues it, a handful close it), so max_tokens would cut it, which says
# nothing about the mask. Every document these allow closes well within max_tokens.


@pytest.fixture(scope="module")
def tokenizer():
    return llama3_tokenizer()


def test_the_tokenizer_encodes_as_metas_own_encoding(tokenizer):
    ranks = load_tiktoken_bpe(str(llama3_tokenizer_file()))
    meta = tiktoken.Encoding(name="llama3", pat_str=PATTERN, mergeable_ranks=ranks,
                             special_tokens={t: len(ranks) + i for i, t in enumerate(SPECIAL_TOKENS)})  # fmt: skip
    assert len(tokenizer) == meta.n_vocab == 128256
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == meta.encode(text, allowed_special="all"), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("hi")[0] == 128000  # <|begin_of_text|> on every encode, as Llama 3's tokenizer adds it
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": " hi "}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    assert rendered == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")  # fmt: skip


def test_every_constrained_output_of_the_second_family_validates(tokenizer, tmp_path: Path):
    model = write_llama3_tiny_checkpoint(tmp_path / "llama3-tiny", tokenizer=tokenizer)
    llm = LLM(str(model), num_blocks=256, max_num_seqs=8)
    try:
        prompts, params, schemas = [], [], []
        for name, schema in SCHEMAS.items():
            messages = [{"role": "user", "content": f"Arguments of {name}, as JSON."}]
            for seed in range(2):
                prompts.append({"prompt_token_ids": llm.chat_prompt(messages)})
                params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                             structured=StructuredSpec(kind="json", text=json.dumps(schema))))  # fmt: skip
                schemas.append(schema)
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    for schema, output in zip(schemas, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # the grammar closed it, and EOT ended it
        jsonschema.validate(json.loads(completion.text), schema)
