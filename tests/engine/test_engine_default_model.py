"""The default SmolLM2 model through the whole engine, squeezed: same greedy tokens as alone."""

from __future__ import annotations

import random

import pytest

from servelm import LLM, SamplingParams
from servelm.testing.reference_decode import greedy_decode

pytestmark = pytest.mark.slow


def test_squeezed_engine_matches_single_sequence_reference():
    # 24 blocks x 16 = 384 slots for 10 prompts of up to ~330 tokens: preemption is certain;
    # a 64-token budget chunks every prompt; the shared system prompt hits the prefix cache.
    # No step-time bound: the budget alone shapes the steps, so preemption and prefix hits do not
    # depend on how fast this host runs them (the time-bound paths have their own exactness tests).
    llm = LLM(None, num_blocks=24, block_size=16, max_num_batched_tokens=64, max_num_seqs=6, max_model_len=384,
              max_step_ms=0)  # fmt: skip
    rng = random.Random(3)
    system = "You are a careful assistant who answers in full sentences. " * 20
    questions = ["Why is the sea salty?", "How do plants grow?", "What is a prime number?", "Who wrote Hamlet?"]
    prompts = []
    for i in range(10):
        body = rng.choice(questions) + " " + " ".join(rng.choice(["please", "briefly", "now"]) for _ in range(i * 5))
        text = (system + body) if i % 2 == 0 else body
        prompts.append(llm.chat_prompt([{"role": "user", "content": text}]))
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 16), ignore_eos=True) for _ in prompts]
    results = llm.generate(prompts, params)

    stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0
    model = llm.engine.core.runner.model
    for prompt, p, result in zip(prompts, params, results):
        assert result.outputs[0].token_ids == greedy_decode(model, prompt, p.max_tokens)
    assert stats.num_used_blocks == 0
