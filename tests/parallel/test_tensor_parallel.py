"""Tensor parallelism: a model split over 2 and 4 real ranks (gloo, one thread each) computes the
single-rank model's logits, within float32 rounding, and its greedy tokens exactly, over a paged KV
pool (a batch of prompts prefilled together, then decode steps). Each rank holds only its shard and
every rank returns the same full logits; a zero-token forward still joins every collective.

One spawn per group size runs every tiny model (spawning costs more than the forwards):
  gqa        Llama 4 heads / 2 KV heads, untied head (TP=4: each KV head on two ranks)
  uneven     6 heads / 3 KV heads, 160 MLP columns, vocab 49157: TP=2 splits all of them unevenly
  tied_bias  Qwen2: tied embeddings, q/k/v bias
  blocks     the gqa model as a Q4_1 GGUF with Q8_0 parts (GGUF blocks; layer 0's q/k/v mixes types and is
             dense; at TP=4 o_proj's 16-column shards cut blocks of 32 and are read dense)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from servelm.default_model import default_model_path
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.models.gguf_loader import gguf_hf_config, load_gguf_weights, open_gguf
from servelm.models.hf_loader import load_safetensors_weights, read_hf_config
from servelm.models.linear_methods import BlockLinearMethod
from servelm.models.llama import LlamaForCausalLM
from servelm.models.rotary import apply_rotary
from servelm.models.sharding import local_num_kv_heads
from servelm.models.weights import CheckpointWeights, select_model_weights
from servelm.parallel.groups import GroupMember, ParallelGroups, ParallelLayout
from servelm.testing.batch_decode import BatchDecode, batch_greedy_decode
from servelm.testing.ranks import run_ranks
from servelm.testing.tiny_model import write_tiny_checkpoint, write_tiny_gguf

PROMPTS = [[5, 91, 7, 300, 12, 44, 8], [17], [250, 3, 3, 9, 120, 77, 61, 2, 800, 14, 5, 33, 40]]
NUM_STEPS = 5  # the prefill's token, then four decode steps
CASES_BY_TP = {2: ["gqa", "uneven", "tied_bias", "blocks"], 4: ["gqa", "tied_bias", "blocks"]}


def load(path: str) -> tuple[ModelArchConfig, CheckpointWeights]:
    """Architecture and lazy weights of a HF directory or a GGUF file (no tokenizer: not needed)."""
    if path.endswith(".gguf"):
        reader = open_gguf(Path(path))
        arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
        return arch, load_gguf_weights(reader, arch, source=path)
    arch = read_hf_config(Path(path))
    return arch, select_model_weights(load_safetensors_weights(Path(path)), arch)


@torch.inference_mode()
def empty_forward_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    """Every piece of the forward but attention (whose metadata needs tokens) on zero tokens, as a rank
    that context parallelism hands no tokens runs it: each row-parallel layer, the embedding and the
    head still join their collective."""
    ids = torch.empty(0, dtype=torch.long)
    hidden = model.embed_tokens(ids)
    cos, sin = model.decoder_layers[0].self_attn.rotary.cos_sin(ids, hidden.dtype)
    shapes = {"embed": tuple(hidden.shape)}
    for layer in model.decoder_layers:
        attn = layer.self_attn
        qkv = attn.qkv_proj(layer.input_layernorm(hidden))
        qk = qkv[:, : attn.q_size + attn.kv_size].view(0, attn.num_heads + attn.num_kv_heads, attn.head_dim)
        shapes["rotary"] = tuple(apply_rotary(qk, cos, sin).shape)
        hidden = hidden + attn.o_proj(qkv[:, : attn.q_size])
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    shapes["hidden"] = tuple(model.norm(hidden).shape)
    shapes["logits"] = tuple(model.compute_logits(hidden).shape)
    return shapes


def decode_on_rank(groups: ParallelGroups, paths: dict[str, str], num_steps: int) -> dict[str, dict[str, Any]]:
    """On one rank: each model built with this rank's shard, the batch decoded, and what it holds."""
    results = {}
    for name, path in paths.items():
        arch, weights = load(path)
        model = build_model(arch, weights, torch.float32, "cpu", tp=groups.tp)
        run = batch_greedy_decode(model, PROMPTS, num_steps)
        results[name] = {
            "run": run,
            "num_params": sum(p.numel() for p in model.parameters()),
            "kv_heads": local_num_kv_heads(arch, groups.tp),
            "empty": empty_forward_shapes(model),
            "block_layers": sum(
                isinstance(m.method, BlockLinearMethod) for m in model.modules() if hasattr(m, "method")
            ),
        }
    return results


def replicated_params(arch: ModelArchConfig, tp: int) -> int:
    """Parameters every rank holds beyond its share: the norms (on every rank), and the K/V rows
    of a KV head held by several ranks (more ranks than KV heads)."""
    norms = (2 * arch.num_hidden_layers + 1) * arch.hidden_size
    extra_kv_heads = max(0, tp - arch.num_key_value_heads)
    kv = extra_kv_heads * arch.head_dim * (2 * arch.hidden_size + (2 if arch.attention_bias else 0))
    return (tp - 1) * norms + kv * arch.num_hidden_layers


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    gqa = write_tiny_checkpoint(root / "gqa", seed=11)
    blocks = write_tiny_gguf(root / "blocks.gguf", gqa, tensor_type=Q.Q4_1,
                           override_types={"blk.0.attn_k.weight": Q.Q8_0, "output.weight": Q.Q8_0})  # fmt: skip
    uneven = write_tiny_checkpoint(root / "uneven", seed=12, hidden_size=96, num_attention_heads=6,
                                   num_key_value_heads=3, intermediate_size=160, vocab_size=49157)  # fmt: skip
    tied_bias = write_tiny_checkpoint(root / "tied_bias", arch="qwen2", seed=13)
    return {"gqa": str(gqa), "uneven": str(uneven), "tied_bias": str(tied_bias), "blocks": str(blocks)}


@pytest.fixture(scope="module")
def single_rank(model_paths: dict[str, str]) -> dict[str, dict[str, Any]]:
    results = {}
    for name, path in model_paths.items():
        arch, weights = load(path)
        model = build_model(arch, weights, torch.float32, "cpu")
        results[name] = {"arch": arch, "run": batch_greedy_decode(model, PROMPTS, NUM_STEPS),
                         "num_params": sum(p.numel() for p in model.parameters())}  # fmt: skip
    return results


@pytest.fixture(scope="module", params=sorted(CASES_BY_TP))
def tp_run(request: pytest.FixtureRequest, model_paths: dict[str, str]) -> tuple[int, list[dict[str, dict[str, Any]]]]:
    tp = request.param
    paths = {name: model_paths[name] for name in CASES_BY_TP[tp]}
    return tp, run_ranks(decode_on_rank, ParallelLayout(tp), (paths, NUM_STEPS), timeout_s=240)


def assert_same_decode(got: BatchDecode, want: BatchDecode, tolerance: float) -> None:
    assert got.tokens == want.tokens
    for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.parametrize("name", ["gqa", "uneven", "tied_bias", "blocks"])
def test_sharded_model_decodes_like_one_rank(tp_run, single_rank, name):
    tp, ranks = tp_run
    if name not in CASES_BY_TP[tp]:
        pytest.skip(f"{name} cannot be split over {tp} ranks")
    reference = single_rank[name]
    arch = reference["arch"]
    assert_same_decode(ranks[0][name]["run"], reference["run"], tolerance=2e-5)
    for rank in ranks[1:]:  # the same full logits on every rank (all-gathered, so the same bits)
        assert rank[name]["run"].tokens == ranks[0][name]["run"].tokens
        for got, want in zip(rank[name]["run"].logits, ranks[0][name]["run"].logits, strict=True):
            assert torch.equal(got, want)
    # Each rank holds its shard only: the ranks' parameters add up to the model's plus what is replicated.
    assert sum(rank[name]["num_params"] for rank in ranks) == reference["num_params"] + replicated_params(arch, tp)
    kv_heads = [rank[name]["kv_heads"] for rank in ranks]
    assert kv_heads == [len(s) for s in _kv_split(arch.num_key_value_heads, tp)]
    hidden, vocab = arch.hidden_size, arch.vocab_size
    expected_empty = {"embed": (0, hidden), "hidden": (0, hidden), "logits": (0, vocab)}
    for rank in ranks:
        assert {k: v for k, v in rank[name]["empty"].items() if k != "rotary"} == expected_empty
        assert rank[name]["empty"]["rotary"][0] == 0
    if name == "blocks":
        assert all(rank[name]["block_layers"] > 0 for rank in ranks)


def _kv_split(num_kv_heads: int, tp: int) -> list[range]:
    # The KV heads a pool holds: a share of them, or one replicated head with more ranks than heads.
    if tp > num_kv_heads:
        return [range(1)] * tp
    base, extra = divmod(num_kv_heads, tp)
    return [range(base + (r < extra)) for r in range(tp)]


def test_one_rank_is_the_unsharded_model(model_paths):
    arch, weights = load(model_paths["gqa"])
    model = build_model(arch, weights, torch.float32, "cpu", tp=GroupMember())
    linears = [m for m in model.modules() if hasattr(m, "reduce")]
    assert linears and all(m.reduce is None and m.columns is None for m in linears)
    assert all(rows is None for m in linears for rows in m.part_rows)
    assert model.embed_tokens.weight.shape == (arch.vocab_size, arch.hidden_size)
    assert local_num_kv_heads(arch, GroupMember()) == arch.num_key_value_heads


@pytest.mark.slow
def test_default_model_at_tp2_decodes_like_one_rank():
    """SmolLM2-135M (GGUF blocks) split over two ranks: 9 heads / 3 KV heads as {0,1} and {2}."""
    path = str(default_model_path())
    prompts_steps = 3
    arch, weights = load(path)
    reference = batch_greedy_decode(build_model(arch, weights, torch.float32, "cpu"), PROMPTS, prompts_steps)
    ranks = run_ranks(decode_on_rank, ParallelLayout(2), ({"default": path}, prompts_steps), timeout_s=240)
    assert [rank["default"]["kv_heads"] for rank in ranks] == [2, 1]
    assert_same_decode(ranks[0]["default"]["run"], reference, tolerance=2e-4)
    assert all(rank["default"]["block_layers"] > 0 for rank in ranks)
