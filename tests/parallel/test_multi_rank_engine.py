"""Multi-rank engines end to end: rank 0 in this process drives real follower processes.

Tensor parallelism (TP=2), context parallelism (CP=2) and both (TP=2 x CP=2, four ranks on this
machine's two cores: slow but real) give the single-sequence reference's greedy tokens through
a workload that chunks prompts, hits the prefix cache and preempts, with the scheduler's
invariants checked every step; the default model's greedy output is unchanged at TP=2 and CP=2.
A rank that dies makes rank 0's next step fail with RankFailedError (not a hang), and the
followers go away with rank 0.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from servelm.config import EngineConfig
from servelm.datatypes import FinishReason
from servelm.engine.builder import build_engine
from servelm.engine.llm import LLM
from servelm.sampling_params import SamplingParams
from servelm.testing.engine_run import ReferenceWorkload, greedy_requests, reference_workload, run_requests
from servelm.worker.multi_rank import RankFailedError

LAYOUTS = {"tp2": (2, 1), "cp2": (1, 2), "tp2-cp2": (2, 2)}


@pytest.fixture(scope="module")
def workload(reference_model) -> ReferenceWorkload:
    """14 requests (every third shares a 70-token prefix), arrival steps and reference outputs."""
    return reference_workload(reference_model, seed=5, count=14, shared_len=70, max_body=150, max_output=24,
                              max_arrival=12)  # fmt: skip


def multi_rank_engine(model: str | None, tp: int, cp: int, **settings):
    config = EngineConfig.from_flat(
        model=model, tensor_parallel_size=tp, context_parallel_size=cp, threads_per_rank=1,
        distributed_timeout_s=30.0, max_step_ms=0,  # the budget alone: preemption whatever the host's speed
        **settings,
    )  # fmt: skip
    return build_engine(config)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_tokens_are_the_references_with_chunks_prefix_hits_and_preemption(tiny_dir, workload, layout):
    tp, cp = LAYOUTS[layout]
    prompts, max_tokens, arrivals, expected = workload.prompts, workload.max_tokens, workload.arrivals, workload.expected
    # 320 tokens of KV (blocks of 8 tokens per rank, cp x 8 per scheduler block) preempt under this load.
    built = multi_rank_engine(str(tiny_dir), tp, cp, num_blocks=40 // cp, block_size=8,
                              max_num_batched_tokens=48, max_num_seqs=8)  # fmt: skip
    try:
        run = run_requests(built.core, greedy_requests(prompts, max_tokens), arrivals)
        for i, want in enumerate(expected):
            assert run.tokens[str(i)] == want, f"request {i} diverged from the reference ({layout})"
            assert run.finish[str(i)] == FinishReason.LENGTH
        stats = built.core.stats()
        assert stats.num_preemptions > 0 and stats.prefix_hits > 0, "the workload was meant to preempt and hit"
        assert stats.num_used_blocks == 0
    finally:
        built.core.close()


DEFAULT_MODEL_PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.", "The three primary colours are"]


def default_model_greedy_tokens(tp: int, cp: int) -> dict:
    built = build_engine(EngineConfig.from_flat(num_blocks=64, tensor_parallel_size=tp, context_parallel_size=cp,
                                                threads_per_rank=1))  # fmt: skip
    try:
        ids = [built.tokenizer.encode(p) for p in DEFAULT_MODEL_PROMPTS]
        return run_requests(built.core, greedy_requests(ids, [24, 24]), [0, 0]).tokens
    finally:
        built.core.close()


@pytest.fixture(scope="module")
def one_rank_default_tokens() -> dict:
    """The default model's greedy tokens on one rank: every layout's reference, computed once."""
    return default_model_greedy_tokens(1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_default_model_greedy_output_is_unchanged(layout, one_rank_default_tokens):
    assert default_model_greedy_tokens(*LAYOUTS[layout]) == one_rank_default_tokens


def followers_of(pid: int) -> list[psutil.Process]:
    return [child for child in psutil.Process(pid).children() if "servelm.worker.rank_main" in " ".join(child.cmdline())]


def test_a_dead_rank_fails_the_next_step_and_followers_leave_with_rank_0(tiny_dir):
    built = multi_rank_engine(str(tiny_dir), 2, 1, num_blocks=32, block_size=8)
    core = built.core
    [follower] = followers_of(os.getpid())
    try:
        run = run_requests(core, greedy_requests([[1, 2, 3, 4]], [4]), [0])
        assert len(run.tokens["0"]) == 4
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait(timeout=10)
        core.add_request(greedy_requests([[5, 6, 7]], [4])[0])
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1"):
            for _ in range(10):
                core.step()
        assert time.monotonic() - started < 30, "a dead rank must fail the step well within the collective timeout"
    finally:
        core.close()
    assert not followers_of(os.getpid())


def _followers() -> list[psutil.Process]:
    return [child for child in psutil.Process().children(recursive=True) if "rank_main" in " ".join(child.cmdline())]


def test_two_parallel_llms_one_after_the_other_in_one_process(tiny_dir):
    """A notebook's pattern: a TP=2 LLM, then a CP=2 one. Each shutdown (the context manager, then
    `del`) stops its followers and leaves the process group, so the next can form its own."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    settings = {"threads_per_rank": 1, "distributed_timeout_s": 30.0, "num_blocks": 32}
    with LLM(str(tiny_dir), tensor_parallel_size=2, **settings) as first:
        tp_tokens = first.generate([[1, 2, 3, 4, 5]], params)[0].outputs[0].token_ids
        assert len(_followers()) == 1
    assert _followers() == [] and not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="shut down"):
        first.generate([[1, 2, 3]], params)
    first.shutdown()  # idempotent
    second = LLM(str(tiny_dir), context_parallel_size=2, **settings)
    assert second.generate([[1, 2, 3, 4, 5]], params)[0].outputs[0].token_ids == tp_tokens  # same greedy tokens
    del second
    assert _followers() == [] and not torch.distributed.is_initialized()
