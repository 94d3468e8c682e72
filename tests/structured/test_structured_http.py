"""Structured outputs over real HTTP with the openai client: response_format (json_object,
json_schema, the client's `parse` with a pydantic model), vLLM's structured_outputs, streaming, and
400s naming the field for specs that cannot be enforced."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pydantic
import pytest

from servelm.server.launcher import launch_server


class Booking(pydantic.BaseModel):
    day: str = pydantic.Field(pattern="^(mon|tue|wed|thu|fri)$")
    hour: int = pydantic.Field(ge=8, le=18)
    people: int = pydantic.Field(ge=1, le=8)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    running = launch_server(None, ["--max-num-seqs", "8"])
    try:
        yield running.base_url
    finally:
        assert running.stop() == 0


def client_of(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_parse_with_a_pydantic_model_and_json_object(server: str) -> None:
    client = client_of(server)
    messages = [{"role": "user", "content": "Book a table for dinner."}]
    for seed in range(3):
        parsed = client.chat.completions.parse(model="SmolLM2-135M-Instruct", messages=messages, response_format=Booking,
                                               temperature=1.0, seed=seed, max_tokens=60)  # fmt: skip
        assert isinstance(parsed.choices[0].message.parsed, Booking)
        assert parsed.choices[0].finish_reason == "stop"
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=1.0, seed=7,
                                           response_format={"type": "json_object"}, max_tokens=80)  # fmt: skip
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.slow
def test_streamed_json_adds_up_and_completions_take_structured_outputs(server: str) -> None:
    client = client_of(server)
    schema = Booking.model_json_schema()
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Book a table."}], temperature=1.0,
        seed=1, max_tokens=60, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "booking", "schema": schema, "strict": True}},
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Call me at", max_tokens=12,
                                           temperature=1.0, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})  # fmt: skip
    assert re.fullmatch(r"\d{3}-\d{4}", completion.choices[0].text)
    choice = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Sentiment of: I loved it"}], n=3,
        temperature=1.0, max_tokens=5, extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )  # fmt: skip
    assert {c.message.content for c in choice.choices} <= {"positive", "negative"}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format", "type"),
        # A keyword the backend cannot enforce is refused by name, never silently dropped.
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "unevaluatedProperties": False}}}},
         "response_format", "unevaluatedProperties"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ],
)  # fmt: skip
def test_a_spec_that_cannot_be_enforced_is_a_400_naming_the_field(server: str, body: dict, param: str, says: str):
    request = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = httpx.post(f"{server}/v1/chat/completions", json={**request, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_metrics_and_the_ttft_breakdown_show_the_grammar(server: str) -> None:
    schema = {"type": "object", "properties": {"metric_probe": {"type": "integer"}}, "required": ["metric_probe"],
              "additionalProperties": False}  # fmt: skip
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}},
            "servelm": {"timeline": True}}  # fmt: skip
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()
    breakdown = reply["servelm"]["timeline"]["ttft_breakdown_ms"]
    assert breakdown["grammar"] >= 0.0 and "grammar_ready" in {e["type"] for e in reply["servelm"]["timeline"]["choices"][0]["events"]}
    metrics = httpx.get(f"{server}/metrics", timeout=30).text

    def value(name: str) -> float:
        [line] = [line for line in metrics.splitlines() if line.startswith(f"servelm:{name}{{")]
        return float(line.rsplit(" ", 1)[1])

    assert value("structured_output_requests_total") >= 1 and value("grammar_compiles_total") >= 1
    assert value("grammar_compile_seconds_total") > 0 and value("grammar_mask_seconds_count") >= 1
