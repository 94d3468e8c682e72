"""servelm's Llama-family forward against transformers on the same random weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2

from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.testing.reference_decode import greedy_decode, prompt_logits

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so test positions cross every band
}
# YaRN as Qwen's long-context configs set it: the ramp between interpolated and kept frequencies,
# and cos/sin scaled by its attention factor (0.1 ln 4 + 1).
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere (biases and norms too): HF's init leaves those at 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.15)


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":
        model = HFQwen2(Qwen2Config(**COMMON, tie_word_embeddings=False))
    elif kind == "qwen2_yarn":
        model = HFQwen2(Qwen2Config(**COMMON, tie_word_embeddings=False, rope_parameters=YARN_ROPE))
    elif kind == "llama3_tied":
        model = HFLlama(LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE))
    else:
        model = HFLlama(LlamaConfig(**COMMON, tie_word_embeddings=False))
    _randomize(model, seed=hash(kind) % 1000)
    return model.eval()


def _ours(hf_model):
    config = hf_model.config.to_dict()
    config["architectures"] = [type(hf_model).__name__]
    arch = ModelArchConfig.from_hf_config(config)
    return build_model(arch, dict(hf_model.state_dict()), torch.float32, "cpu")


KINDS = ["llama", "qwen2", "llama3_tied", "qwen2_yarn"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    hf = _hf_model(request.param)
    return hf, _ours(hf)


def test_arch_is_read_from_config(pair):
    hf, ours = pair
    assert ours.arch.attention_bias == (hf.config.model_type == "qwen2")
    assert ours.arch.tie_word_embeddings == hf.config.tie_word_embeddings
    scaling = ours.arch.rope_scaling
    if scaling is not None and scaling.rope_type == "yarn":
        assert scaling.factor == 4.0 and scaling.original_max_position_embeddings == 64
        assert ours.decoder_layers[0].self_attn.rotary.attention_factor == pytest.approx(1.1386, abs=1e-4)
    elif scaling is not None:
        assert scaling.rope_type == "llama3" and ours.arch.rope_theta == 500000.0


def test_prompt_logits_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids.unsqueeze(0)).logits[0]
    actual = prompt_logits(ours, [ids.tolist()])[0]
    assert actual.shape == expected.shape
    # Within 1e-4 of the logits' scale (relative), as the foundation issue asks.
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_greedy_32_tokens_match_transformers(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(2)
    for length in (1, 7, 40):
        prompt = torch.randint(0, VOCAB, (length,), generator=gen)
        with torch.no_grad():
            expected = hf.generate(
                prompt.unsqueeze(0), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, length:].tolist()
        assert greedy_decode(ours, prompt.tolist(), 32, block_size=4) == expected


def test_flattened_batch_equals_each_alone(pair):
    _, ours = pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 17, 5, 64)]
    together = prompt_logits(ours, prompts)
    for prompt, logits in zip(prompts, together):
        torch.testing.assert_close(logits, prompt_logits(ours, [prompt])[0], rtol=1e-5, atol=1e-5)


def test_logits_depend_on_position(pair):
    """Guard against a rotary embedding that silently does nothing (RoPE is relative: change a gap)."""
    _, ours = pair
    from servelm.attention.backend import CommonAttentionInputs
    from servelm.worker.model_runner import attention_backend_of

    ids = torch.tensor([5, 9, 13])
    metadata = attention_backend_of(ours).build_metadata(CommonAttentionInputs.for_prompts([3]))
    at_zero = ours.compute_logits(ours(ids, torch.arange(3), metadata))
    spread = ours.compute_logits(ours(ids, torch.tensor([0, 50, 51]), metadata))
    torch.testing.assert_close(at_zero[0], spread[0])  # the first token sees only itself
    assert not torch.allclose(at_zero[1:], spread[1:], atol=1e-4)
