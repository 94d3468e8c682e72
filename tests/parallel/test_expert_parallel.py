"""Expert parallelism: a mixture of experts over 2 real ranks (gloo, one thread each) holds half the
routed experts on each rank, reads only those experts' tensors, and decodes the single-rank model's
greedy tokens with its logits within float32 rounding. Latent attention (DeepSeek) splits its heads
over the same ranks and caches its latent whole on each. Then the engine at -tp 2 over real rank
processes: greedy equal to one rank, through paging, chunks and prefix hits.

  qwen2_moe    8 experts top-3, a gated shared expert (its columns split), a dense middle layer
  mixtral      8 experts top-2, Mixtral's tensor names
  deepseek_v3  latent attention, 16 experts in groups, a shared expert, a dense first layer
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.config import EngineConfig
from servelm.engine.builder import build_engine
from servelm.models.factory import build_model
from servelm.models.hf_loader import load_safetensors_weights, read_hf_config
from servelm.models.moe import SparseMoE
from servelm.models.weights import CheckpointWeights, select_model_weights
from servelm.parallel.groups import ParallelGroups, ParallelLayout
from servelm.testing.batch_decode import batch_greedy_decode
from servelm.testing.engine_run import greedy_requests, run_requests
from servelm.testing.ranks import run_ranks
from servelm.testing.tiny_model import write_tiny_checkpoint

PROMPTS = [[5, 91, 7, 300, 12, 44, 8], [17], [250, 3, 3, 9, 120, 77, 61, 2, 800, 14, 5, 33, 40]]
NUM_STEPS = 5
KINDS = {"qwen2_moe": {"mlp_only_layers": [1]}, "mixtral": {}, "deepseek_v3": {}}


def recording_weights(path: str) -> tuple[Any, CheckpointWeights, list[str]]:
    """(arch, the checkpoint's weights, the names read so far): every tensor read is recorded."""
    arch = read_hf_config(Path(path))
    weights = select_model_weights(load_safetensors_weights(Path(path)), arch)
    names: list[str] = []

    def read(name: str):
        names.append(name)
        return weights[name]

    def read_shard(name: str, rows: range | None, columns: range | None):
        names.append(name)
        return weights.read_shard(name, rows, columns)

    infos = {name: weights.info(name) for name in weights}
    return arch, CheckpointWeights(infos, read, weights.source, read_shard), names


def decode_on_rank(groups: ParallelGroups, paths: dict[str, str]) -> dict[str, dict[str, Any]]:
    results = {}
    for name, path in paths.items():
        arch, weights, read = recording_weights(path)
        model = build_model(arch, weights, torch.float32, "cpu", tp=groups.tp)
        layers = [layer.mlp for layer in model.decoder_layers if isinstance(layer.mlp, SparseMoE)]
        results[name] = {
            "run": batch_greedy_decode(model, PROMPTS, NUM_STEPS),
            "experts": [(layer.experts.start, layer.experts.stop) for layer in layers],
            "expert_tensors_read": sorted({n for n in read if ".experts." in n}),
        }
    return results


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ep")
    return {kind: str(write_tiny_checkpoint(root / kind, kind, seed=21, num_hidden_layers=3, **overrides))
            for kind, overrides in KINDS.items()}  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(model_paths: dict[str, str]) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(decode_on_rank, ParallelLayout(2), (model_paths,), timeout_s=240)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_experts_split_over_two_ranks_decode_as_one(two_ranks, model_paths, kind) -> None:
    arch, weights, read = recording_weights(model_paths[kind])
    alone = batch_greedy_decode(build_model(arch, weights, torch.float32, "cpu"), PROMPTS, NUM_STEPS)
    every_expert_tensor = sorted({n for n in read if ".experts." in n})
    assert arch.moe is not None
    for rank in two_ranks:
        got = rank[kind]["run"]
        assert got.tokens == alone.tokens
        for step, (g, w) in enumerate(zip(got.logits, alone.logits, strict=True)):
            torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5, msg=lambda m, s=step: f"step {s}: {m}")
    # Each rank holds and reads half the experts, the two halves covering them once.
    half = arch.moe.num_experts // 2
    assert [rank[kind]["experts"][0] for rank in two_ranks] == [(0, half), (half, arch.moe.num_experts)]
    first, second = (set(rank[kind]["expert_tensors_read"]) for rank in two_ranks)
    assert not first & second and sorted(first | second) == every_expert_tensor


def test_the_engine_at_tp2_serves_a_latent_moe_greedy_as_one_rank(model_paths) -> None:
    path = model_paths["deepseek_v3"]
    prompts = [PROMPTS[0] * 6, PROMPTS[0] * 6 + [9, 10, 11], PROMPTS[2] * 3, PROMPTS[1]]
    tokens = {}
    for tp in (1, 2):
        config = EngineConfig.from_flat(model=path, num_blocks=32, block_size=4, max_num_batched_tokens=16,
                                        enable_prefix_caching=True, max_step_ms=0, tensor_parallel_size=tp)  # fmt: skip
        built = build_engine(config)
        try:
            run = run_requests(built.core, greedy_requests(prompts, [8] * len(prompts)), [0, 2, 2, 3])
            stats = built.core.stats()
        finally:
            built.core.close()
        tokens[tp] = run.tokens
        assert stats.prefix_hits > 0
    assert tokens[2] == tokens[1]


def test_context_parallelism_refuses_a_mixture_of_experts_by_name(model_paths) -> None:
    config = EngineConfig.from_flat(model=model_paths["mixtral"], num_blocks=8, context_parallel_size=2)
    with pytest.raises(ValueError, match="context parallelism does not run mixtures of experts"):
        build_engine(config)
