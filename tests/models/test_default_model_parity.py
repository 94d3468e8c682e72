"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): servelm vs transformers, greedy.

transformers loads the same GGUF (`gguf_file=`), dequantizing to float32 itself; both
must pick the same 32 tokens for every chat prompt, and the text must read as English.
"""

from __future__ import annotations

import re

import pytest
import torch

from servelm.default_model import default_model_path
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.testing.reference_decode import greedy_decode, prompt_logits

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "Give me three tips for staying healthy.",
    "Explain what a computer does, briefly.",
    "What colour is the sky on a clear day?",
    "Name a fruit that is yellow.",
]
COMMON_WORDS = {
    "the", "a", "an", "is", "of", "and", "to", "in", "it", "you", "that", "for", "are", "on", "with",
    "as", "be", "can", "your", "this", "or", "by", "which", "from", "its", "i", "not",
}  # fmt: skip


@pytest.fixture(scope="module")
def ours():
    checkpoint = load_checkpoint(None)
    return build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu"), checkpoint.tokenizer


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def test_default_model_config(ours):
    model, tokenizer = ours
    arch = model.arch
    assert (arch.num_hidden_layers, arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads) == (
        30, 576, 9, 3,
    )  # fmt: skip
    assert arch.vocab_size == 49152 and arch.tie_word_embeddings
    assert "<|im_start|>" in tokenizer.chat_template


def test_prompt_logits_match_transformers(ours, reference):
    model, tokenizer = ours
    ids = _chat_ids(tokenizer, PROMPTS[0])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    actual = prompt_logits(model, [ids])[0]
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_greedy_chat_matches_transformers_and_reads_as_english(ours, reference):
    model, tokenizer = ours
    stop = tuple({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    for prompt in PROMPTS:
        ids = _chat_ids(tokenizer, prompt)
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=list(stop), pad_token_id=0
            )[0, len(ids) :].tolist()
        actual = greedy_decode(model, ids, 32, stop_token_ids=stop)
        assert actual == expected, f"diverged on {prompt!r}"
        text = tokenizer.decode(actual, skip_special_tokens=True)
        words = re.findall(r"[a-z]+", text.lower())
        assert len(words) >= 3 and COMMON_WORDS & set(words), f"not English-looking: {text!r}"
    paris = tokenizer.decode(greedy_decode(model, _chat_ids(tokenizer, PROMPTS[0]), 32, stop_token_ids=stop))
    assert "Paris" in paris
