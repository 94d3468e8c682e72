"""DeepSeek-V3's multi-head latent attention and routing, beyond the parity of test_moe_parity.py:
the KV pool holds the latent and the RoPE key per token and nothing else, a checkpoint without the
low-rank q projection, YaRN as V3 publishes it, the router against transformers' own, the multi-token-prediction layer
skipped at load and said so, and the engine's other paths over a latent pool (layered prefill,
speculative verification with a self-speculative draft, an int8 pool) against transformers' greedy
tokens."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from servelm.config import EngineConfig
from servelm.engine.builder import build_engine
from servelm.models.arch import MoEConfig
from servelm.models.factory import build_model
from servelm.models.hf_loader import load_hf_directory
from servelm.models.moe import route
from servelm.testing.engine_run import greedy_requests, record_layer_slices, run_requests
from servelm.testing.reference_decode import prompt_logits
from servelm.testing.tiny_model import write_tiny_checkpoint
from servelm.worker.kv_cache import allocate_kv_caches, bytes_per_block


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("deepseek") / "model", "deepseek_v3", seed=7)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), path


def test_the_pool_stores_the_latent_and_the_rope_key_per_token_only(deepseek) -> None:
    _, path = deepseek
    arch, _, _ = load_hf_directory(path)
    assert arch.mla is not None and arch.mla.latent_dim == 32 + 8
    pools = allocate_kv_caches(arch, num_blocks=4, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    assert len(pools) == 3 and all(tuple(p.shape) == (1, 4, 16, 1, 40) for p in pools)  # type: ignore[union-attr]
    per_token = bytes_per_block(arch, 16, torch.float32) / 16
    assert per_token == 3 * 40 * 4  # layers x (kv_lora_rank + qk_rope_head_dim) x float32
    full_heads = 3 * 2 * arch.num_attention_heads * arch.mla.qk_head_dim * 4  # K and V of every head
    assert full_heads / per_token == pytest.approx(4.8)


# As V3 publishes it (factor 40 over 4,096 positions) but small: positions past the original
# context cross the ramp; mscale != mscale_all_dim so both the cos/sin factor and the softmax scale show.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.8}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        pytest.param("deepseek_v3", {"q_lora_rank": None}, id="no-low-rank-q"),
        pytest.param("deepseek_v3", {"rope_parameters": YARN}, id="yarn"),
        # DeepSeek-V2-Lite's shape of choices: no low-rank q, one group ("greedy"), YaRN.
        pytest.param("deepseek_v2", {"q_lora_rank": None, "topk_method": "greedy", "rope_parameters": YARN}, id="v2-lite"),
    ],
)
def test_other_configurations_match_transformers(tmp_path: Path, kind, overrides) -> None:
    path = write_tiny_checkpoint(tmp_path / "model", kind, seed=2, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    arch, weights, _ = load_hf_directory(path)
    assert arch.mla is not None and (arch.mla.q_lora_rank is None) == ("q_lora_rank" in overrides)
    assert (arch.rope_scaling is not None) == ("rope_parameters" in overrides)
    ours = build_model(arch, weights, torch.float32, "cpu")
    ids = torch.randint(0, hf.config.vocab_size, (150,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids.unsqueeze(0)).logits[0]
    actual = prompt_logits(ours, [ids.tolist()])[0]
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize(("experts", "top_k", "groups", "topk_group"), [(16, 4, 4, 2), (256, 8, 8, 4)])
def test_routing_chooses_the_experts_transformers_does(experts, top_k, groups, topk_group) -> None:
    """Sigmoid scores, the bias only in the choice, the best groups, renormalised and scaled: the
    same experts and weights as transformers' router on 10k random tokens, at a small shape and at
    DeepSeek-V3's (256 experts in 8 groups, the best 4 groups searched, top 8)."""
    config = DeepseekV3Config(hidden_size=32, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=groups,
                              topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.5)
    moe = MoEConfig("deepseek_v3", experts, top_k, 8, True, frozenset({0}), scoring="sigmoid", num_groups=groups,
                    topk_group=topk_group, routed_scaling_factor=2.5)  # fmt: skip
    x = torch.randn(10_000, 32)
    _, want_weights, want_experts = router(x)
    weights, experts = route(x @ router.weight.T, moe, router.e_score_correction_bias)
    order, want_order = experts.argsort(dim=-1), want_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), want_experts.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))
    # The bias decides: without it other experts win for some tokens.
    _, unbiased = route(x @ router.weight.T, moe, None)
    assert not torch.equal(unbiased.sort(dim=-1).values, experts.sort(dim=-1).values)


@pytest.mark.parametrize("topk_method", ["group_limited_greedy", "greedy"])
def test_deepseek_v2_routing_chooses_the_experts_transformers_does(topk_method) -> None:
    """V2: softmax scores, a group scored by its best expert (or no groups: "greedy"), no renormalisation,
    scaled; on 10k random tokens at DeepSeek-V2's sizes (160 experts in 8 groups, the best 3, top 6)."""
    config = DeepseekV2Config(hidden_size=32, n_routed_experts=160, num_experts_per_tok=6, n_group=8, topk_group=3,
                              topk_method=topk_method, routed_scaling_factor=16.0)  # fmt: skip
    router = DeepseekV2TopkRouter(config)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    moe = MoEConfig.from_hf_config("deepseek_v2", {**config.to_dict(), "moe_intermediate_size": 8}, 1)
    x = torch.randn(10_000, 32)
    _, want_weights, want_experts = router(x)
    weights, experts = route(x @ router.weight.T, moe)
    order, want_order = experts.argsort(dim=-1), want_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), want_experts.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))


def test_the_multi_token_prediction_layer_is_skipped_and_said_so(tmp_path: Path, caplog) -> None:
    path = write_tiny_checkpoint(tmp_path / "model", "deepseek_v3", seed=1)
    tensors = load_file(str(path / "model.safetensors"))
    # As published: one more layer past num_hidden_layers (3), with the MTP module's own tensors.
    extra = {name.replace("model.layers.2.", "model.layers.3."): t.clone() for name, t in tensors.items() if ".layers.2." in name}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="servelm.models.weights"):
        arch, weights, _ = load_hf_directory(path)
    assert arch.num_hidden_layers == 3 and not any(".layers.3." in name for name in weights)
    assert "skipping layer(s) [3]" in caplog.text and "multi-token-prediction" in caplog.text


@pytest.mark.parametrize(
    "overrides",
    [
        # 1 µs: below any step, so every prompt step takes the floor, a few layers of a chunk.
        pytest.param({"max_step_ms": 0.001, "max_num_batched_tokens": 512}, id="layered-prefill"),
        # A self-speculative draft (the first layer) always proposes: every step verifies 1 + 3
        # tokens per request after cached context, the short-query rows over the latent pool.
        pytest.param({"speculative_config": {"method": "draft", "draft_num_layers": 1, "num_speculative_tokens": 3,
                                             "adaptive": False}}, id="draft-verification"),  # fmt: skip
    ],
)
def test_the_engines_other_paths_over_a_latent_pool_are_transformers_greedy(deepseek, overrides) -> None:
    hf, path = deepseek
    rng = random.Random(9)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (120, 40, 80)]
    max_tokens = [12, 16, 10]
    expected = {}
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected[str(i)] = out[0, len(prompt):].tolist()
    config = EngineConfig.from_flat(model=str(path), num_blocks=64, block_size=16, **overrides)
    built = build_engine(config)
    slices = record_layer_slices(built.core.scheduler)
    try:
        run = run_requests(built.core, greedy_requests(prompts, max_tokens), [0, 0, 1])
        stats = built.core.stats()
    finally:
        built.core.close()
    assert run.tokens == expected
    if "max_step_ms" in overrides:
        assert slices, "the bound was meant to run chunks a few layers a step"
    if "speculative_config" in overrides:
        assert stats.spec_num_draft_tokens > 0


def test_an_int8_latent_pool_serves(deepseek) -> None:
    """Quantized, the latent is one plane of codes with a scale per token: the engine serves from it
    (its tokens drift from float32's in places, as any int8 pool's do: accuracy is the benchmark's)."""
    _, path = deepseek
    config = EngineConfig.from_flat(model=str(path), num_blocks=32, block_size=16, kv_cache_dtype="int8")
    built = build_engine(config)
    try:
        run = run_requests(built.core, greedy_requests([list(range(100, 160))], [8]), [0])
        pool = built.core.runner.kv_caches[0]
    finally:
        built.core.close()
    assert len(run.tokens["0"]) == 8
    assert tuple(pool.data.shape[::4]) == (1, 40) and tuple(pool.scales.shape[3:]) == (1,)  # type: ignore[union-attr]
