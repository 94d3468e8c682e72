"""Structured outputs in the engine, on the default model: every output matches its spec (sampled
at temperature 1.0, where a free model wanders), and constraining one request changes no other's."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest

from servelm.engine.llm import LLM, RequestFailedError
from servelm.sampling_params import SamplingParams, StructuredSpec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "$defs": {
        "item": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2},
                   "express": {"type": "boolean"}},
    "required": ["items", "express"], "additionalProperties": False,
}  # fmt: skip
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8)


def json_spec(schema: dict) -> StructuredSpec:
    return StructuredSpec(kind="json", text=json.dumps(schema))


@pytest.mark.slow
def test_sampled_json_always_validates_against_its_schema(llm: LLM) -> None:
    prompts = ["Describe a customer as JSON.", "Write an order as JSON.", "Call a tool with no arguments."]
    schemas = [PERSON, ORDER, NO_PARAMETERS]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured=json_spec(schema))
              for schema in schemas for seed in range(3)]  # fmt: skip
    outputs = llm.generate([p for p in prompts for _ in range(3)], params)
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # the grammar ended it, not the limit
        jsonschema.validate(json.loads(completion.text), schemas[i // 3])


@pytest.mark.slow
def test_regex_choice_and_grammar_hold(llm: LLM) -> None:
    specs = [
        StructuredSpec(kind="regex", text=r"\d{3}-\d{4}"),
        StructuredSpec(kind="choice", text='["positive", "negative", "neutral"]'),
        StructuredSpec(kind="grammar", text='root ::= "yes" | "no" | "maybe"'),
    ]
    prompts = ["A phone number:", "Sentiment of 'great movie':", "Will it rain?"]
    outputs = llm.generate(prompts, [SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured=s) for s in specs])
    texts = [o.outputs[0].text for o in outputs]
    assert re.fullmatch(r"\d{3}-\d{4}", texts[0]), texts
    assert texts[1] in ("positive", "negative", "neutral") and texts[2] in ("yes", "no", "maybe"), texts


@pytest.mark.slow
def test_a_constrained_neighbour_changes_no_free_request(llm: LLM) -> None:
    """Greedy free requests give the same tokens alone and batched with constrained ones (the masks
    are per row), and a constrained greedy request is the same alone and batched."""
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=80, structured=json_spec(PERSON))
    prompts = ["The history of Rome", "Describe a customer as JSON.", "Ten facts about cats", "A person as JSON:"]
    alone = [llm.generate([p], [s])[0].outputs[0].token_ids
             for p, s in zip(prompts, [free, constrained, free, constrained])]  # fmt: skip
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, [free, constrained, free, constrained])]
    assert batched == alone


def test_a_continuation_resumes_the_grammar_after_the_tokens_it_is_given(llm: LLM) -> None:
    """A migrated stream's continuation: the prompt ends with the output sent so far and
    structured_resume_tokens says how much of it is output; the grammar goes on from there, so the
    greedy continuation is the rest of the undisturbed output. Output the grammar never allowed fails."""
    prompt = llm.encode("Describe a customer as JSON.")
    whole = SamplingParams(temperature=0.0, max_tokens=80, structured=json_spec(PERSON))
    [output] = llm.generate([prompt], [whole])
    first = output.outputs[0].token_ids
    assert output.outputs[0].finish_reason == "stop" and len(first) > 12
    cut = 9  # mid-object: a grammar started over here would have to open a new object
    resumed = SamplingParams(temperature=0.0, max_tokens=80 - cut, structured=json_spec(PERSON),
                             structured_resume_tokens=cut)  # fmt: skip
    [rest] = llm.generate([prompt + first[:cut]], [resumed])
    assert first[:cut] + rest.outputs[0].token_ids == first
    jsonschema.validate(json.loads(output.outputs[0].text), PERSON)
    off_grammar = llm.encode(" not json")[-2:]
    with pytest.raises(RequestFailedError, match="does not match the constraint"):
        llm.generate([prompt + off_grammar], [msgspec.structs.replace(resumed, structured_resume_tokens=2)])
    with pytest.raises(ValueError, match="needs a structured-output constraint"):
        SamplingParams(max_tokens=4, structured_resume_tokens=2)


def test_a_spec_that_does_not_compile_fails_its_request_with_the_reason(llm: LLM) -> None:
    """The API refuses bad specs first; the engine's own check fails the request (an error naming
    the cause, not a hang), and the engine serves on."""
    bad = SamplingParams(max_tokens=8, structured=StructuredSpec(kind="regex", text="[a-"))
    with pytest.raises(RequestFailedError, match="unclosed character class"):
        llm.generate(["x"], [bad])
    [output] = llm.generate(["y"], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
    assert len(output.outputs[0].token_ids) == 4


@pytest.mark.slow
def test_the_xgrammar_backend_holds_outputs_too() -> None:
    llm = LLM(max_num_seqs=4, structured_outputs_backend="xgrammar")
    try:
        outputs = llm.generate(["Describe a customer as JSON.", "A phone number:"], [
            SamplingParams(temperature=1.0, seed=1, max_tokens=120, structured=json_spec(PERSON)),
            SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured=StructuredSpec(kind="regex", text=r"\d{3}-\d{4}")),
        ])  # fmt: skip
        jsonschema.validate(json.loads(outputs[0].outputs[0].text), PERSON)
        assert re.fullmatch(r"\d{3}-\d{4}", outputs[1].outputs[0].text)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_speculation_keeps_constrained_greedy_output_and_verifies_drafts(llm: LLM) -> None:
    """Drafts are cut at the first token the grammar refuses and each verified position is masked
    by the grammar after the drafts before it: greedy output is the same as without speculation."""
    schema = {"type": "array", "items": ORDER["$defs"]["item"], "minItems": 4, "maxItems": 4}
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured=json_spec(s)) for s in (schema, PERSON)]
    prompts = ["List four order lines as JSON.", "A customer as JSON:"]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = LLM(max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})  # fmt: skip
    try:
        speculated = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
        stats = spec.engine.core.stats()
    finally:
        spec.shutdown()
    assert speculated == plain
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0, stats
