"""The fused decode path (models/fused_decode.py, csrc/decode_layers.c) against the op-by-op path on the
same engine: the same greedy tokens and, step by step, the same top logprobs within float32 rounding,
over batches of 1..5 decodes, short queries after context (speculative verification), a
self-speculative draft (its first layers only), preemption, and prefix hits; it is taken exactly when
it applies; bad tables are refused before anything is read or written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from servelm.config import EngineConfig
from servelm.datatypes import EventType
from servelm.default_model import default_model_path
from servelm.engine.builder import assemble_engine
from servelm.engine.core import EngineCore
from servelm.kernels.arguments import KernelArgumentError
from servelm.kernels.decode_layers import DecodeLayersCall
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.models.fused_decode import FusedDecodeLayers
from servelm.models.gguf_loader import gguf_hf_config, load_gguf_weights, open_gguf
from servelm.models.linear_methods import MAX_BLOCK_ROWS, small_batch_kernel
from servelm.obs.startup import StartupTimeline
from servelm.testing.engine_run import EngineRun, assert_same_run, greedy_requests, run_requests
from servelm.testing.tiny_model import write_tiny_checkpoint, write_tiny_gguf
from servelm.tokenization.loading import load_gguf_tokenizer

pytestmark = pytest.mark.skipif(small_batch_kernel() is None, reason="no C compiler: the kernels cannot be built here")


@pytest.fixture(scope="module")
def tiny_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GQA Llama (4 heads over 2 KV heads, 2 layers) as Q4_1, with layer 1's o_proj Q4_0 and
    layer 0's MLP Q8_0: every linear layer block-stored, in all three block types."""
    root = tmp_path_factory.mktemp("fused")
    hf_dir = write_tiny_checkpoint(root / "hf", arch="llama", seed=5, init_std=0.3)
    overrides = {"blk.1.attn_output.weight": Q.Q4_0, "blk.0.ffn_gate.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q8_0,
                 "blk.0.ffn_down.weight": Q.Q8_0, "output.weight": Q.Q8_0}  # fmt: skip
    return write_tiny_gguf(root / "tiny.gguf", hf_dir, tensor_type=Q.Q4_1, override_types=overrides)


def _engine(path: Path, **overrides: object) -> EngineCore:
    """An engine core over the tiny GGUF (which has no tokenizer: the default model's stands in)."""
    settings: dict[str, object] = {"num_blocks": 96, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                                  "max_step_ms": 0}  # the budget alone: preemption whatever the host speed
    config = EngineConfig.from_flat(model=str(path), **(settings | overrides))
    reader = open_gguf(path)
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    model = build_model(arch, load_gguf_weights(reader, arch, source=str(path)), torch.float32, "cpu")
    return assemble_engine(config, model, arch, load_gguf_tokenizer(default_model_path()), str(path), None,
                           StartupTimeline()).core  # fmt: skip


def _run_both(core: EngineCore, prompts: list[list[int]], max_tokens: list[int], arrivals: list[int],
              logprobs: int | None = 5) -> tuple[EngineRun, EngineRun, list[int]]:  # fmt: skip
    """The workload fused, then op by op on the same engine; and the rows of each step that took the fused call."""
    fused = core.runner.model.fused_decode
    assert isinstance(fused, FusedDecodeLayers)
    calls = []
    original_run = fused.run

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original_run(*args, **kwargs)

    fused.run = counted  # type: ignore[method-assign]
    requests = greedy_requests(prompts, max_tokens)
    for request in requests:
        request.sampling_params.logprobs = logprobs
    with_fused = run_requests(core, requests, arrivals)
    core.runner.model.fused_decode = None
    try:
        requests = greedy_requests(prompts, max_tokens)
        for request in requests:
            request.sampling_params.logprobs = logprobs
        op_by_op = run_requests(core, requests, arrivals)
    finally:
        core.runner.model.fused_decode = fused
        del fused.run
    return with_fused, op_by_op, calls


def test_fused_decode_steps_match_the_op_by_op_path(tiny_blocks: Path):
    core = _engine(tiny_blocks)
    assert core.runner.model.fused_decode is not None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (3, 17, 9, 30, 5)]
    prompts.append(prompts[1][:12] + [7, 8])  # a prefix hit on request 1's blocks
    got, want, fused_steps = _run_both(core, prompts, [40, 25, 33, 12, 28, 20], [0, 0, 2, 5, 5, 30])
    assert_same_run(got, want)
    assert len(fused_steps) > 30 and max(fused_steps) == 5  # most steps are pure decode steps of 1..5 rows


def test_preemption_and_a_self_speculative_draft_match(tiny_blocks: Path):
    """Too few blocks for everyone (preemption, recompute); then speculative steps: the draft's
    first-layer forwards and the verification's short queries after context go fused."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (11, 14, 8, 13)]
    core = _engine(tiny_blocks, num_blocks=24)
    got, want, fused_steps = _run_both(core, prompts, [40, 40, 40, 40], [0, 0, 0, 0])
    assert_same_run(got, want)
    preempted = [e for events in got.events.values() for e in events if e.type is EventType.PREEMPTED]
    assert fused_steps and preempted
    speculative = {"method": "draft", "draft_num_layers": 1, "num_speculative_tokens": 3, "adaptive": False}
    core = _engine(tiny_blocks, speculative_config=speculative)
    got, want, fused_steps = _run_both(core, prompts, [30, 30, 30, 30], [0, 0, 1, 1], logprobs=None)
    assert got.tokens == want.tokens and fused_steps


def test_taken_only_where_it_applies(tiny_blocks: Path, monkeypatch: pytest.MonkeyPatch):
    """Not for an int8 pool or many rows (op by op there, with the same tokens), nor with the fusion off."""
    prompts = [[5, 6, 7], [9, 10], [11], [12, 13]] * 3  # 12 decodes at once: more rows than the block matmul takes
    for overrides, expect_fused in (({"kv_cache_dtype": "int8"}, False), ({"max_num_seqs": 12}, True)):
        core = _engine(tiny_blocks, **overrides)
        got, want, fused_steps = _run_both(core, prompts, [6] * 12, [0] * 11 + [4], logprobs=None)
        assert got.tokens == want.tokens
        # 12 rows at once never go fused; the last request's lone steps do when the pool allows.
        assert bool(fused_steps) is expect_fused and max(fused_steps, default=0) <= MAX_BLOCK_ROWS, overrides
    monkeypatch.setenv("SERVELM_KERNELS", "unfused")
    assert _engine(tiny_blocks).runner.model.fused_decode is None


def test_bad_tables_and_slots_are_refused_before_any_write(tiny_blocks: Path):
    core = _engine(tiny_blocks)
    fused = core.runner.model.fused_decode
    pools = core.runner.kv_caches
    prepared = fused._prepared_layers(pools)
    before = [pool.clone() for pool in pools]
    g = prepared.geometry
    hidden = torch.randn(1, g.hidden_size)
    cos_sin = torch.ones(1, g.head_dim // 2)
    table = torch.zeros(1, 2, dtype=torch.int32)
    cases = {
        "slot past the pool": (table, torch.tensor([3], dtype=torch.int32), torch.tensor([96 * 4])),
        "block id past the pool": (
            torch.tensor([[0, 96]], dtype=torch.int32),
            torch.tensor([6], dtype=torch.int32),
            torch.tensor([5]),
        ),  # fmt: skip
        "seq_len past the table": (table, torch.tensor([9], dtype=torch.int32), torch.tensor([5])),
    }
    for name, (tables, lens, slots) in cases.items():
        call = DecodeLayersCall(prepared, hidden.clone(), None, tables, lens, 9, slots, cos_sin, cos_sin, 0.25, 1)
        with pytest.raises(KernelArgumentError, match="row 0"):
            fused.kernel.decode_layers(prepared, call, 2)
        assert all(torch.equal(a, b) for a, b in zip(pools, before)), name
    with pytest.raises(KernelArgumentError, match="slots"):
        DecodeLayersCall(prepared, hidden, None, table, torch.tensor([3], dtype=torch.int32), 8,
                         torch.tensor([5], dtype=torch.int32), cos_sin, cos_sin, 0.25, 1)  # fmt: skip
