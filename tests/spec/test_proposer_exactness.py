"""Each token-only proposer on: the same greedy tokens as the single-sequence reference, through the
engine exactness harness (random prompts with repeats so proposals happen, a pool that preempts,
a budget that chunks, shared prefixes that hit), on a tiny model and on the default model."""

from __future__ import annotations

import json
import random

import pytest

from servelm import LLM, SamplingParams
from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import build_engine
from servelm.testing.engine_run import run_requests
from servelm.testing.reference_decode import greedy_decode

METHODS = ["ngram", "suffix"]


def _spec(method: str, adaptive: bool = False) -> str:
    return json.dumps(
        {
            "method": method,
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "adaptive": adaptive,
        }
    )


def _repetitive_prompts(seed: int, count: int, vocab: int) -> list[list[int]]:
    """Prompts made of a few repeated phrases (n-grams recur), a third behind a shared prefix."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 6))] for _ in range(6)]
    shared = [t for _ in range(20) for t in rng.choice(phrases)]
    prompts = []
    for i in range(count):
        body = [t for _ in range(rng.randint(1, 40)) for t in rng.choice(phrases)]
        prompts.append((shared if i % 3 == 0 else []) + body)
    return prompts


@pytest.mark.serial  # the controller proposes only where drafts pay at the measured step times: the machine to itself
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "controller"])
def test_tiny_model_greedy_matches_reference(tiny_dir, reference_model, method, adaptive):
    vocab = reference_model.arch.vocab_size
    prompts = _repetitive_prompts(seed=13, count=18, vocab=vocab)
    rng = random.Random(14)
    max_tokens = [rng.randint(1, 48) for _ in prompts]
    arrivals = [rng.randint(0, 25) for _ in prompts]
    config = EngineConfig.from_flat(
        model=str(tiny_dir), num_blocks=40, block_size=16, max_num_batched_tokens=64, max_num_seqs=10,
        speculative_config=_spec(method, adaptive),
        max_step_ms=0,  # the budget alone shapes steps: the preemption it needs does not depend on host speed
    )  # fmt: skip
    core = build_engine(config).core
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    requests = [
        EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=params[i]) for i, p in enumerate(prompts)
    ]
    tokens = run_requests(core, requests, arrivals).tokens
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == greedy_decode(reference_model, prompt, max_tokens[i]), f"request {i} diverged"
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0
    assert stats.spec_num_draft_tokens > 0, "the proposer never proposed"
    assert stats.num_used_blocks == 0


@pytest.fixture(scope="module")
def default_model_plain_run() -> tuple[list[list[int]], SamplingParams, list[list[int]]]:
    """(prompts, params, greedy tokens) of the default model without speculation: computed once,
    the reference every proposer's run is compared with."""
    source = open(__file__).read()[:1500]  # a real file, asked back: output repeats the prompt
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with LLM(None, num_blocks=256, max_num_batched_tokens=256) as plain:
        prompts = [
            plain.chat_prompt([{"role": "user", "content": "Repeat this file exactly:\n" + source}]),
            plain.chat_prompt([{"role": "user", "content": "Count from 1 to 40, comma separated."}]),
        ]
        want = [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    return prompts, params, want


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_default_model_greedy_unchanged(default_model_plain_run, method):
    prompts, params, want = default_model_plain_run
    with LLM(None, num_blocks=256, max_num_batched_tokens=256, speculative_config=_spec(method)) as spec:
        got = [r.outputs[0].token_ids for r in spec.generate(prompts, params)]
        assert got == want
        assert spec.engine.core.stats().spec_num_accepted_tokens > 0
