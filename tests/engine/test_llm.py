"""The offline LLM API over the real engine: sampling features end to end on a tiny model."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.testing.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=3)
    return LLM(str(model_dir), num_blocks=128, block_size=16, max_num_batched_tokens=64)


def _prompts(llm, count, length=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, llm.engine.arch.vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


def test_seeded_sampling_is_independent_of_the_batch(llm):
    [target] = _prompts(llm, 1, seed=1)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    others = _prompts(llm, 6, length=37, seed=2)
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(others[:3] + [target] + others[3:], [noise] * 3 + [params] + [noise] * 3)
    assert mixed[3].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = {tuple(llm.generate([target], unseeded)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(runs) > 1, "unseeded sampling should differ between runs"


def test_seeded_sampling_survives_preemption(tmp_path):
    """A seeded request preempted and resumed produces what it produces when never preempted."""
    model_dir = write_tiny_checkpoint(tmp_path / "model", seed=3)
    roomy = LLM(str(model_dir), num_blocks=256, block_size=16)
    # No step-time bound: the budget alone shapes the steps, so the preemption does not depend on host speed.
    cramped = LLM(str(model_dir), num_blocks=40, block_size=16, max_num_batched_tokens=64, max_step_ms=0)
    prompts = _prompts(roomy, 6, length=90, seed=4)
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=20, ignore_eos=True) for s in range(6)]
    expected = [r.outputs[0].token_ids for r in roomy.generate(prompts, params)]
    actual = [r.outputs[0].token_ids for r in cramped.generate(prompts, params)]
    assert cramped.engine.core.stats().num_preemptions > 0
    assert actual == expected


def test_n_completions_share_the_prompt_blocks(llm):
    [prompt] = _prompts(llm, 1, length=64, seed=5)
    before = llm.engine.core.stats().prefix_hits
    result = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in result.outputs)
    # The later siblings found the first one's full blocks (48 of 64 tokens: the last block is kept uncached).
    assert llm.engine.core.stats().prefix_hits - before >= 2 * 48


def test_max_tokens_min_tokens_and_stop_token(llm):
    [prompt] = _prompts(llm, 1, seed=6)
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert len(greedy.token_ids) == 10 and greedy.finish_reason == "length"
    stop_id = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_id)
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]))[0]
    out = stopped.outputs[0]
    assert out.token_ids == greedy.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    held = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id], min_tokens=first + 2)
    )[0].outputs[0]
    assert stop_id not in held.token_ids[: first + 2]


def test_stop_string_cuts_text_and_frees_the_request(llm):
    [prompt] = _prompts(llm, 1, seed=8)
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], ignore_eos=True))[0]
    assert out.outputs[0].text == full.text[: full.text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert llm.engine.core.stats().num_used_blocks == 0


def test_logprobs_and_prompt_logprobs(llm):
    [prompt] = _prompts(llm, 1, length=40, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    result = llm.generate([prompt], params)[0]
    out = result.outputs[0]
    assert len(out.logprobs) == 5
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert position.chosen.token_id == token_id and position.chosen.rank == 1  # greedy = top-1
        assert len(position.top) == 3 and position.top[0].token_id == token_id
        assert position.top[0].logprob >= position.top[1].logprob >= position.top[2].logprob
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    for token_id, position in zip(prompt[1:], result.prompt_logprobs[1:]):
        assert position.chosen.token_id == token_id and len(position.top) == 2
        assert position.chosen.logprob <= position.top[0].logprob + 1e-6 and not math.isnan(position.chosen.logprob)


def test_text_prompts_and_chat_template(llm):
    ids = llm.chat_prompt([{"role": "user", "content": "hi"}])
    assert llm.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    out = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt == "Hello there" and out.prompt_token_ids == llm.encode("Hello there")
    with pytest.raises(ValueError, match="context window"):
        llm.generate([[1] * 5000], SamplingParams(max_tokens=1))


def test_n_seeded_choices_differ_and_share_blocks_at_the_default_budget(tmp_path):
    """n=4 with a seed: four different samples, the same four again for the same seed, and the
    siblings hit the first choice's prompt blocks with the default token budget (all four fit one
    step, so sharing comes from the fan-out's order, not from a budget that splits them)."""
    model_dir = write_tiny_checkpoint(tmp_path / "model", seed=3)
    llm = LLM(str(model_dir), num_blocks=256, block_size=16)  # scheduler defaults
    [prompt] = _prompts(llm, 1, length=70, seed=11)
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    before = llm.engine.core.stats().prefix_hits
    first = [o.token_ids for o in llm.generate([prompt], params)[0].outputs]
    hits = llm.engine.core.stats().prefix_hits - before
    assert len({tuple(t) for t in first}) == 4, "each choice must sample with its own seed"
    assert hits == 3 * 64, "each sibling finds the 4 full prompt blocks the first choice computed"
    again = [o.token_ids for o in llm.generate([prompt], params)[0].outputs]
    assert again == first
    other_seed = [o.token_ids for o in llm.generate([prompt], msgspec.structs.replace(params, seed=43))[0].outputs]
    assert other_seed != first
