"""The engine builder's start-up phases (issue 16), on the real builder and a tiny checkpoint:

- every phase is recorded, announced as it begins, in the order it runs;
- the compiled kernels are built in kernel_build, and a second start finds them in the cache;
- the warm-up really runs a prefill and a decode through the runner, and leaves nothing behind:
  no request in the runner, its block table row and KV blocks as allocated, no block held or
  hashed, no counter moved, no proposer state; the engine's greedy output stays the reference's.
"""

from __future__ import annotations

import pytest
import torch

from servelm import envs
from servelm.attention.backend import AttentionMetadata, CommonAttentionInputs, register_backend
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import assemble_engine, build_engine
from servelm.kernels import build as kernel_build
from servelm.kernels import cpu as cpu_kernels
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.obs.startup import StartupTimeline
from servelm.sampling_params import SamplingParams
from servelm.spec.suffix import SuffixProposer
from servelm.testing.reference_decode import greedy_decode
from servelm.worker.warmup import (
    CALIBRATION_PROMPT_TOKENS,
    CALIBRATION_REPEATS,
    WARMUP_MANY_ROWS_TOKENS,
    WARMUP_PROMPT_TOKENS,
)

ENGINE_PHASES = ["kernel_build", "load", "kv_sizing", "warmup"]


class QueryLensBackend(TorchAttentionBackend):
    """The real torch backend, noting each step's query lengths (one entry per forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.query_lens: list[list[int]] = []

    def build_metadata(self, common: CommonAttentionInputs) -> AttentionMetadata:
        self.query_lens.append(common.query_lens.tolist())
        return super().build_metadata(common)


register_backend("test-warmup-query-lens", QueryLensBackend)


def test_every_phase_is_announced_then_recorded_in_order(tiny_dir):
    announced: list[str] = []
    startup = StartupTimeline(on_phase=announced.append)
    build_engine(EngineConfig.from_flat(model=str(tiny_dir), num_blocks=32), startup=startup)
    assert announced == ENGINE_PHASES
    assert [record.name for record in startup.records] == ENGINE_PHASES
    for earlier, later in zip(startup.records, startup.records[1:]):
        assert earlier.ended_at <= later.started_at + 1e-3, "the builder's phases run one after another"


def test_a_second_start_finds_the_compiled_kernels_in_the_cache(tiny_dir, tmp_path, monkeypatch):
    try:
        kernel_build.find_toolchain()
    except kernel_build.KernelBuildError as exc:
        pytest.skip(f"no C compiler here: {exc}")
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(envs.KERNELS, "auto")
    config = EngineConfig.from_flat(model=str(tiny_dir), num_blocks=32)
    seconds: list[float] = []
    try:
        for _ in range(2):
            cpu_kernels.reset()  # each start is a fresh process as far as the kernels know
            startup = StartupTimeline()
            build_engine(config, startup=startup)
            seconds.append(startup.seconds_by_phase()["kernel_build"])
            [library] = (tmp_path / "cache" / "kernels").glob("*.so")
            if len(seconds) == 1:
                built = library.stat().st_mtime_ns
    finally:
        cpu_kernels.reset()  # later tests decide again, in the environment monkeypatch restores
    assert library.stat().st_mtime_ns == built, "the second start rebuilt the library"
    first, second = seconds
    assert second < first / 4, f"kernel_build: {first:.3f} s compiling, {second:.3f} s from the cache"


def test_warm_up_runs_a_prefill_and_a_decode_and_leaves_nothing_behind(tiny_dir, reference_model):
    checkpoint = load_checkpoint(tiny_dir)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu", "test-warmup-query-lens")
    backend = model.layers[0].self_attn.backend
    assert isinstance(backend, QueryLensBackend)
    config = EngineConfig.from_flat(
        model="unused", num_blocks=16, block_size=4, enable_prefix_caching=True,
        speculative_config='{"method": "suffix", "num_speculative_tokens": 3}',
    )  # fmt: skip
    core = assemble_engine(config, model, checkpoint.arch, checkpoint.tokenizer, "test").core

    calibrated = [n for n in CALIBRATION_PROMPT_TOKENS if n + 1 <= 16 * 4]  # what the 64-token pool holds
    assert calibrated, "the pool holds at least the shortest calibration prompt"
    # a prefill, then one decode token; again for a many-row prompt
    expected = [[WARMUP_PROMPT_TOKENS], [1], [WARMUP_MANY_ROWS_TOKENS], [1]]
    for n in calibrated:  # then each calibration prompt, and a decode after it, CALIBRATION_REPEATS times
        expected += [[n], [1]] * CALIBRATION_REPEATS
    assert backend.query_lens == expected
    runner, kv = core.runner, core.kv_manager
    assert runner.requests == {}
    assert not runner.block_table.table.any() and runner.block_table.num_blocks == [0] * config.scheduler.max_num_seqs
    assert all(not tensor.any() for tensor in runner.kv_block_tensors), "the warm-up's blocks are zeroed again"
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks, stats.prefix_queries, stats.prefix_hits,
            stats.spec_num_drafts, stats.num_preemptions) == (0, 0, 0, 0, 0, 0, 0)  # fmt: skip
    assert core.take_step_records() == []  # the calibration's timings went to the cost model only
    proposer = runner.proposer
    assert isinstance(proposer, SuffixProposer)
    assert proposer.num_requests == 0 and proposer.finished.num_requests == 0

    prompt = list(range(12))  # starts with the warm-up's prompt (0..7): its blocks were never cached
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    core.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt, sampling_params=params))
    tokens: list[int] = []
    while core.has_work():
        tokens += [t for output in core.step() for t in output.new_token_ids]
    assert tokens == greedy_decode(reference_model, prompt, 8)
    assert core.stats().prefix_hits == 0


def test_the_step_cost_model_is_fitted_before_the_first_request(tiny_dir):
    """The calibration's timed steps seed the scheduler's step-cost model: a step-time target
    binds from the first long prompt next to a decoding stream on, instead of the static budget
    until four real steps of different sizes ran."""
    core = build_engine(EngineConfig.from_flat(model=str(tiny_dir), num_blocks=64, block_size=16)).core
    coefficients = core.scheduler.step_cost.coefficients()
    assert coefficients is not None and all(c >= 0 for c in coefficients)
    assert core.scheduler.step_cost.calibrated_fixed_s is not None
    assert core.scheduler.step_target_s() is not None  # the default target, from the calibration
