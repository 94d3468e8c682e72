"""Verifying drafts changes speed, never output: the real engine with a scripted proposer whose
drafts are right or wrong at random (so every acceptance length occurs).

- greedy: tokens equal the single-sequence reference under preemption, chunking and prefix hits,
  with the KV invariants checked after every step;
- seeded sampling with penalties, min_tokens and logprobs: the same tokens and logprobs as the
  same engine without drafts (the seed's stream is wound back past rejected draws).
"""

from __future__ import annotations

import random

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest, EventType, FinishReason
from servelm.engine.builder import build_engine
from servelm.sampling_params import SamplingParams
from servelm.testing.engine_run import prefix_sharing_prompts, run_requests
from servelm.testing.reference_decode import greedy_decode
from servelm.testing.scripted_proposer import ScriptedProposer

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}'


def _run(core, requests: list[EngineRequest], arrivals: list[int]):
    run = run_requests(core, requests, arrivals)
    return run.tokens, run.logprobs, run.finish, run.events


def _prompts(seed: int, count: int, vocab: int) -> list[list[int]]:
    return prefix_sharing_prompts(random.Random(seed), count, vocab, shared_len=150, max_body=300)


def test_greedy_output_is_the_reference_whatever_is_accepted(tiny_dir, reference_model):
    vocab = reference_model.arch.vocab_size
    prompts = _prompts(seed=3, count=24, vocab=vocab)
    rng = random.Random(4)
    max_tokens = [rng.randint(1, 40) for _ in prompts]
    expected = {str(i): greedy_decode(reference_model, p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))}
    proposer = ScriptedProposer(
        {rid: prompts[int(rid)] + out for rid, out in expected.items()}, vocab, mistake_rate=0.4, seed=5
    )
    # 40 blocks × 16: long prompts cannot coexist → preemption; a 64-token budget chunks prompts.
    config = EngineConfig.from_flat(
        model=str(tiny_dir), num_blocks=40, block_size=16, max_num_batched_tokens=64, max_num_seqs=12,
        max_step_ms=0,  # the budget alone shapes steps: the preemption it needs does not depend on host speed
        speculative_config=SPEC,
    )  # fmt: skip
    built = build_engine(config, proposer=proposer)
    requests = [
        EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, max_tokens))
    ]  # fmt: skip
    tokens, _, finish, events = _run(built.core, requests, [rng.randint(0, 20) for _ in prompts])

    for request_id, want in expected.items():
        assert tokens[request_id] == want, f"request {request_id} diverged"
        assert finish[request_id] == FinishReason.LENGTH
    counters = built.core.scheduler.spec_counters
    assert counters is not None and counters.num_drafts > 0
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, "acceptance was meant to be partial"
    accepted = [e.detail for evs in events.values() for e in evs if e.type is EventType.SPEC_VERIFIED]
    assert sum(accepted) == counters.num_accepted_tokens and 0 in accepted and max(accepted) == 4
    stats = built.core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0, "the workload was meant to preempt and hit"
    assert stats.num_used_blocks == 0
    # Every step that decoded a request with drafts counts as one verification.
    assert counters.accepted_per_position[0] >= counters.accepted_per_position[-1]


def test_seeded_sampling_with_penalties_is_unchanged_by_drafts(tiny_dir):
    vocab = 128
    prompts = _prompts(seed=9, count=10, vocab=vocab)

    def params(i: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.8, top_p=0.9, top_k=40, seed=100 + i, max_tokens=30, min_tokens=5 + i,
            frequency_penalty=0.3, repetition_penalty=1.2, logprobs=2, ignore_eos=i % 2 == 0,
        )  # fmt: skip

    requests = [
        EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=params(i)) for i, p in enumerate(prompts)
    ]
    arrivals = [i // 2 for i in range(len(prompts))]
    base = dict(model=str(tiny_dir), num_blocks=128, block_size=16, max_num_batched_tokens=128)
    plain = build_engine(EngineConfig.from_flat(**base))
    want_tokens, want_logprobs, want_finish, _ = _run(plain.core, requests, arrivals)

    proposer = ScriptedProposer(
        {r.request_id: r.prompt_token_ids + want_tokens[r.request_id] for r in requests}, vocab, 0.5, seed=1
    )
    spec = build_engine(EngineConfig.from_flat(**base, speculative_config=SPEC), proposer=proposer)
    tokens, logprobs, finish, _ = _run(spec.core, requests, arrivals)
    assert tokens == want_tokens
    assert finish == want_finish
    for request_id, want in want_logprobs.items():
        got = logprobs[request_id]
        assert [p.chosen.token_id for p in got] == [p.chosen.token_id for p in want]
        assert [[t.token_id for t in p.top] for p in got] == [[t.token_id for t in p.top] for p in want]
        assert all(abs(a.chosen.logprob - b.chosen.logprob) < 1e-4 for a, b in zip(got, want))
    assert spec.core.scheduler.spec_counters.num_accepted_tokens > 0
    assert spec.core.stats().num_used_blocks == 0
