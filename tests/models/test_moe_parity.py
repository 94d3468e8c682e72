"""Mixtures of experts (Mixtral, Qwen2-MoE with its gated shared expert and a dense layer, Qwen3-MoE
with q/k norms, DeepSeek-V3 with latent attention, grouped sigmoid routing and a dense first layer)
and dense Qwen3 against transformers, on tiny random models saved as published
checkpoints are (sharded safetensors with an index, one tensor per expert) and loaded by servelm's
loader: prompt logits, greedy tokens, and the batched engine's greedy output with paging, prefix
caching, chunked prefill and preemption."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from servelm.config import EngineConfig
from servelm.engine.builder import build_engine
from servelm.models.factory import build_model
from servelm.models.hf_loader import load_hf_directory
from servelm.models.moe import SparseMoE
from servelm.testing.engine_run import greedy_requests, run_requests
from servelm.testing.reference_decode import prompt_logits
from servelm.testing.tiny_model import write_tiny_checkpoint

KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3", "deepseek_v3", "deepseek_v2"]
# Three layers; Qwen2-MoE's middle one dense (mlp_only_layers), as its published configs allow.
OVERRIDES = {"qwen2_moe": {"mlp_only_layers": [1]}}
SPARSE_LAYERS = {"mixtral": 3, "qwen2_moe": 2, "qwen3_moe": 3, "qwen3": 0, "deepseek_v3": 2, "deepseek_v2": 2}


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """(transformers' model read back from the directory, the directory): several safetensors
    shards with an index, as published checkpoints are."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "model", request.param, seed=3,
                                 max_shard_size="2MB", num_hidden_layers=3, **OVERRIDES.get(request.param, {}))  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), path


def test_the_checkpoint_is_sharded_with_one_tensor_per_expert(checkpoint) -> None:
    hf, path = checkpoint
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    if hf.config.model_type == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in weight_map
    elif hf.config.model_type != "qwen3":
        assert "model.layers.2.mlp.experts.0.gate_proj.weight" in weight_map  # (DeepSeek's layer 0 is dense)


def test_prompt_logits_match_transformers_and_each_token_is_routed_alone(checkpoint) -> None:
    hf, path = checkpoint
    arch, weights, _ = load_hf_directory(path)
    ours = build_model(arch, weights, torch.float32, "cpu")
    sparse = [layer.mlp for layer in ours.decoder_layers if isinstance(layer.mlp, SparseMoE)]
    assert len(sparse) == SPARSE_LAYERS[hf.config.model_type]
    ids = torch.randint(0, hf.config.vocab_size, (200,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids.unsqueeze(0)).logits[0]
    actual = prompt_logits(ours, [ids.tolist()])[0]
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    # A batch of prompts flattened together routes each token alone: the same logits as each by itself.
    prompts = [ids[:17].tolist(), ids[50:51].tolist(), ids[100:164].tolist()]
    for prompt, logits in zip(prompts, prompt_logits(ours, prompts)):
        torch.testing.assert_close(logits, prompt_logits(ours, [prompt])[0], rtol=1e-5, atol=1e-5)


def test_the_engine_is_transformers_greedy_with_paging_prefix_hits_chunks_and_preemption(checkpoint) -> None:
    hf, path = checkpoint
    rng = random.Random(5)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(48)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randint(5, 150))] for i in range(8)]
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    expected = {}
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected[str(i)] = out[0, len(prompt):].tolist()
    # 24 blocks of 16 for ~8 prompts of up to ~200 tokens: preemption; a 64-token budget: chunks.
    config = EngineConfig.from_flat(model=str(path), num_blocks=24, block_size=16, max_num_batched_tokens=64,
                                    max_num_seqs=6, enable_prefix_caching=True, max_step_ms=0)  # fmt: skip
    built = build_engine(config)
    try:
        run = run_requests(built.core, greedy_requests(prompts, max_tokens), [i * 2 for i in range(len(prompts))])
        stats = built.core.stats()
    finally:
        built.core.close()
    assert run.tokens == expected
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0, "the workload was meant to preempt and hit"
