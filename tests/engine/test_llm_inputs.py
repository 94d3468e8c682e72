"""The offline API's inputs: every prompt form vLLM's LLM.generate accepts works; a malformed one
raises a clear error before reaching the engine; a request that fails inside a step fails alone,
and the same LLM (or core process) serves the next request."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from servelm import LLM, SamplingParams
from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest, FinishReason
from servelm.engine.async_client import AsyncEngineClient
from servelm.testing.tiny_model import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), num_blocks=128, block_size=16, max_num_batched_tokens=64)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


def test_every_vllm_prompt_form_gives_the_same_tokens(llm):
    ids = llm.encode("Hello there")
    [expected] = _tokens(llm, [ids])
    forms = [
        "Hello there", ids, tuple(ids), {"prompt": "Hello there"}, {"prompt_token_ids": ids},
        [np.int64(t) for t in ids], ["Hello there"], [{"prompt": "Hello there"}], [{"prompt_token_ids": ids}],
    ]  # fmt: skip
    for form in forms:
        assert _tokens(llm, form) == [expected], form
    mixed = _tokens(llm, ["Hello there", ids, {"prompt": "Hello there"}, {"prompt_token_ids": ids}])
    assert mixed == [expected] * 4
    out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    assert out.prompt is None and out.prompt_token_ids == ids


MALFORMED = [
    ([{"prompt_token_ids": ["a", "b"]}], TypeError, "token ids must be ints"),
    ([{"prompt_token_ids": [1, True]}], TypeError, "token ids must be ints"),
    ([{"prompt_token_ids": "1 2 3"}], TypeError, "must be a list of ints"),
    ([{"prompt_ids": [1, 2]}], ValueError, "a dict prompt must be"),
    ([{"prompt": 5}], ValueError, "a dict prompt must be"),
    ([{"prompt": "x", "prompt_token_ids": [1]}], ValueError, "a dict prompt must be"),
    ([[1, 2, 49152]], ValueError, "token id 49152 is out of range"),
    ([[1, -1]], ValueError, "token id -1 is out of range"),
    ([[1, 2**70]], ValueError, "out of range"),
    (["ok", [1, "x"]], TypeError, "prompt 1"),
    ([], ValueError, "prompts is empty"),
    (42, TypeError, "prompts must be"),
    ([3.5], TypeError, "prompt 0"),
    ([[]], ValueError, "empty"),
]


@pytest.mark.parametrize("prompts, error, says", MALFORMED, ids=[m[2] + str(i) for i, m in enumerate(MALFORMED)])
def test_malformed_prompts_raise_and_the_llm_still_serves(llm, prompts, error, says):
    with pytest.raises(error, match=says):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.core.has_work(), "nothing may reach the engine"
    assert len(_tokens(llm, "Hello there")[0]) == 4


def test_malformed_sampling_params_raise(llm):
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate("hi", [{"temperature": 0}])
    with pytest.raises(ValueError, match="stop_token_ids entry 10000000 is out of range"):
        llm.generate("hi", SamplingParams(stop_token_ids=[10_000_000]))
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(temperature=float("inf"))
    with pytest.raises(ValueError, match="64-bit"):
        SamplingParams(seed=2**64)


def _bad_request(request_id: str) -> EngineRequest:
    """Below validation: a token id outside the embedding table makes the step itself fail."""
    return EngineRequest(request_id=request_id, prompt_token_ids=[1, 2, 49152 + 7], sampling_params=GREEDY)


def test_a_request_failing_inside_a_step_fails_alone_in_process(llm):
    core = llm.engine.core
    core.add_request(_bad_request("poison"))
    outputs = []
    while core.has_work():
        outputs.extend(core.step())
    [failed] = [o for o in outputs if o.request_id == "poison"]
    assert failed.finish_reason == FinishReason.ERROR and "step failed" in (failed.error or "")
    core.scheduler.check_invariants()
    assert core.stats().num_used_blocks == 0 or core.kv_manager.num_free_blocks > 0
    assert len(_tokens(llm, "Hello there")[0]) == 4  # the same LLM serves on
    # Through generate(): the failure is an exception after the step, and the engine is empty again.
    core.add_request(_bad_request("poison-2"))
    while core.has_work():
        core.step()
    assert not core.has_work() and core.stats().num_running == 0


def test_a_failing_step_of_several_requests_fails_only_the_one_to_blame(llm, caplog):
    """The poison shares its steps with good requests (one mid-prefill in 64-token chunks): they are
    retried alone, only the poison fails, and the others produce exactly what they produce alone."""
    good = [list(range(100, 200)), list(range(300, 310)), list(range(400, 420))]
    expected = _tokens(llm, good)
    core = llm.engine.core
    for i, prompt in enumerate(good):
        core.add_request(EngineRequest(request_id=f"good-{i}", prompt_token_ids=prompt, sampling_params=GREEDY))
    core.add_request(_bad_request("poison"))
    tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason | None] = {}
    while core.has_work():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                finish[output.request_id] = output.finish_reason
        core.scheduler.check_invariants()
    assert finish == {"good-0": FinishReason.LENGTH, "good-1": FinishReason.LENGTH, "good-2": FinishReason.LENGTH,
                      "poison": FinishReason.ERROR}  # fmt: skip
    assert [tokens[f"good-{i}"] for i in range(3)] == expected
    assert core.stats().num_used_blocks == 0
    shared = [r for r in caplog.records if "engine step of" in r.getMessage() and "of 1 request" not in r.getMessage()]
    assert shared, "the poison must have failed a step it shared with others"


def test_a_request_failing_inside_a_step_fails_alone_in_the_core_process(tiny_dir):
    async def scenario():
        client = AsyncEngineClient(EngineConfig.from_flat(model=str(tiny_dir), num_blocks=64, num_threads=1))
        await client.start()
        try:
            queue = await client.add_request(_bad_request("poison"))
            output = await asyncio.wait_for(queue.get(), timeout=60)
            assert output.finish_reason == FinishReason.ERROR and client.dead_error is None
            good = EngineRequest(request_id="good", prompt_token_ids=list(range(10, 40)), sampling_params=GREEDY)
            queue = await client.add_request(good)
            tokens = []
            while True:
                output = await asyncio.wait_for(queue.get(), timeout=60)
                tokens.extend(output.new_token_ids)
                if output.finish_reason is not None:
                    break
            assert output.finish_reason == FinishReason.LENGTH and len(tokens) == 4
            assert client.stats.num_used_blocks == 0 and client.num_in_flight == 0
        finally:
            await client.shutdown()

    asyncio.run(scenario())
