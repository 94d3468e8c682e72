"""Batching, paging, chunked prefill, preemption and prefix caching must not change greedy output.

A randomized workload goes through the real engine (scheduler + runner + tiny model) with a
KV pool small enough to force preemptions and a token budget small enough to force
chunked prefill; every request must produce exactly the tokens the single-sequence
reference (itself checked against transformers in tests/models) produces alone.
"""

from __future__ import annotations

import random

import pytest

from servelm.config import EngineConfig
from servelm.datatypes import DEFAULT_SLO, EngineRequest, FinishReason, RequestSlo
from servelm.engine.builder import build_engine
from servelm.sampling_params import SamplingParams
from servelm.testing.engine_run import record_layer_slices
from servelm.testing.reference_decode import greedy_decode


def _workload(seed: int, count: int, vocab: int):
    """Prompts of 1..600 tokens; a third extend one of two long shared prefixes."""
    rng = random.Random(seed)
    shared = [[rng.randrange(vocab) for _ in range(n)] for n in (200, 333)]
    prompts = []
    for i in range(count):
        if i % 3 == 0:
            base = shared[i % 2]
            prompt = base + [rng.randrange(vocab) for _ in range(rng.randint(1, 600 - len(base)))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 600))]
        prompts.append((prompt, rng.randint(1, 24), rng.randint(0, 30)))  # tokens, max_tokens, arrival step
    return prompts


def _run(core, workload, max_steps: int = 20000, priorities=None, slos=None):
    """Feed requests in at their arrival steps (with priorities[i], default 0, and slos[i], default
    DEFAULT_SLO); collect tokens and finish reasons per request, and count the steps it took."""
    tokens = {str(i): [] for i in range(len(workload))}
    finish = {}
    step = 0
    while len(finish) < len(workload):
        for i, (prompt, max_tokens, arrival) in enumerate(workload):
            if arrival == step:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                priority = priorities[i] if priorities else 0
                slo = slos[i] if slos else DEFAULT_SLO
                core.add_request(
                    EngineRequest(
                        request_id=str(i), prompt_token_ids=prompt, sampling_params=params, priority=priority, slo=slo
                    )
                )
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                finish[output.request_id] = output.finish_reason
        core.kv_manager.check_invariants()
        step += 1
        assert step < max_steps, "engine did not finish the workload"
    return tokens, finish, step


def test_randomized_workload_matches_reference(tiny_dir, reference_model):
    vocab = reference_model.arch.vocab_size
    workload = _workload(seed=11, count=40, vocab=vocab)
    # 48 blocks x 16 = 768 token slots: a handful of 600-token prompts cannot coexist → preemption.
    config = EngineConfig.from_flat(
        model=str(tiny_dir), num_blocks=48, block_size=16, max_num_batched_tokens=96, max_num_seqs=16,
        enable_prefix_caching=True, max_step_ms=0,  # the budget alone: preemption whatever the host's speed
    )
    built = build_engine(config)
    tokens, finish, _ = _run(built.core, workload)

    stats = built.core.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert stats.prefix_hits > 0, "shared prefixes were meant to hit the cache"
    for i, (prompt, max_tokens, _) in enumerate(workload):
        expected = greedy_decode(reference_model, prompt, max_tokens)
        assert tokens[str(i)] == expected, f"request {i} (prompt {len(prompt)} tokens) diverged"
        assert finish[str(i)] == FinishReason.LENGTH
    assert stats.num_used_blocks == 0


def _contended_engine(tiny_dir):
    """A pool small enough to preempt, a budget that caps chunks and leaves prompts a step out,
    fast aging: every ordering mechanism at work."""
    config = EngineConfig.from_flat(
        model=str(tiny_dir), num_blocks=48, block_size=16, max_num_batched_tokens=96, max_num_seqs=16,
        max_num_partial_prefills=2, long_prefill_token_threshold=16, aging_s=0.05,
    )  # fmt: skip
    return build_engine(config)


def test_classes_slots_and_aging_change_order_not_results(tiny_dir, reference_model):
    """Better classes overtaking running prompts, capped chunks that sit a step out and are topped
    up, and aged requests started in whatever blocks are free: the same greedy tokens."""
    vocab = reference_model.arch.vocab_size
    workload = _workload(seed=23, count=24, vocab=vocab)
    priorities = [random.Random(i).randint(0, 2) for i in range(len(workload))]
    built = _contended_engine(tiny_dir)
    tokens, finish, _ = _run(built.core, workload, priorities=priorities)
    assert built.core.stats().num_preemptions > 0, "the pool was meant to be small enough to preempt"
    for i, (prompt, max_tokens, _) in enumerate(workload):
        assert tokens[str(i)] == greedy_decode(reference_model, prompt, max_tokens), f"request {i} diverged"
        assert finish[str(i)] == FinishReason.LENGTH
    assert built.core.stats().num_used_blocks == 0


def test_slo_classes_and_tenants_change_order_not_results(tiny_dir, reference_model):
    """Deadline order across classes, fair share between tenants of a class and the step-time
    target from a realtime TBT target: the same greedy tokens; evictions counted per tenant."""
    vocab = reference_model.arch.vocab_size
    workload = _workload(seed=31, count=24, vocab=vocab)
    classes = [("realtime", 0.3, 0.05), ("batch", 30.0, None), ("default", None, None)]
    rng = random.Random(31)
    slos = []
    for _ in workload:
        name, ttft, tbt = rng.choice(classes)
        slos.append(RequestSlo(tenant=rng.choice(["t0", "t1", "t2"]), slo_class=name, ttft_target_s=ttft, tbt_target_s=tbt))
    built = _contended_engine(tiny_dir)
    tokens, finish, _ = _run(built.core, workload, slos=slos)
    stats = built.core.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert {"t0", "t1", "t2"} <= set(stats.prefix_evictions_by_tenant) and sum(stats.prefix_evictions_by_tenant.values()) > 0
    for i, (prompt, max_tokens, _) in enumerate(workload):
        assert tokens[str(i)] == greedy_decode(reference_model, prompt, max_tokens), f"request {i} diverged"
        assert finish[str(i)] == FinishReason.LENGTH
    assert stats.num_used_blocks == 0 and stats.num_prefilling == 0


def test_prefix_cache_skips_work_not_results(tiny_dir):
    built = build_engine(EngineConfig.from_flat(model=str(tiny_dir), num_blocks=64, block_size=16))
    prompt = list(range(100, 100 + 70))  # 4 full blocks + 6 tokens
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for request_id in ("first", "second"):
        built.core.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))
        collected, cached = [], None
        while built.core.has_work():
            for out in built.core.step():
                collected.extend(out.new_token_ids)
                cached = out.num_cached_tokens if out.num_cached_tokens else cached
        outputs[request_id] = (collected, cached)
    assert outputs["first"][0] == outputs["second"][0]
    assert outputs["first"][1] in (None, 0)
    assert outputs["second"][1] == 64  # the four full blocks; the tail is recomputed
    stats = built.core.stats()
    assert stats.prefix_hits == 64


@pytest.mark.parametrize("layered", [True, False])
def test_step_time_target_changes_chunking_not_results(tiny_dir, reference_model, layered):
    """A step-time target sizes every step by the learned cost model: many more, smaller chunks
    (or, with layered prefill, chunks run a few layers a step), and the same greedy tokens."""
    vocab = reference_model.arch.vocab_size
    workload = _workload(seed=5, count=12, vocab=vocab)
    steps = {}
    for max_step_ms in (0.0, 0.001):  # 1 µs: below any step, so every step takes the floor
        config = EngineConfig.from_flat(
            model=str(tiny_dir), num_blocks=256, block_size=16, max_num_batched_tokens=512, max_step_ms=max_step_ms,
            layered_prefill=layered,
        )  # fmt: skip
        built = build_engine(config)
        slices = record_layer_slices(built.core.scheduler)
        tokens, _, steps[max_step_ms] = _run(built.core, workload)
        for i, (prompt, max_tokens, _) in enumerate(workload):
            assert tokens[str(i)] == greedy_decode(reference_model, prompt, max_tokens), f"request {i} diverged"
        assert built.core.scheduler.step_cost.coefficients() is not None
        assert built.core.stats().num_used_blocks == 0
        assert bool(slices) == (layered and max_step_ms > 0), "layer slices only where layered prefill is on and bound"
        assert any(s.end_layer < len(built.core.runner.model.decoder_layers) for s in slices) or not slices
    assert steps[0.001] > 1.3 * steps[0.0], steps  # the same work in smaller steps
