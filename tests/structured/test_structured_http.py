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
    # Sampled: \d is ASCII under every backend (test_regex_semantics.py), so 12 tokens always suffice.
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Call me at", max_tokens=12,
                                           temperature=1.0, seed=3,
                                           extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", completion.choices[0].text)
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


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
NO_PARAMS = {"type": "function", "function": {"name": "list_files"}}
ARRAY_OF_OBJECTS = {"type": "function", "function": {"name": "add_events", "parameters": {
    "type": "object", "properties": {"count": {"type": "integer", "minimum": 1, "maximum": 3}, "events": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 12}, "day": {"enum": ["mon", "tue"]}},
            "required": ["title", "day"], "additionalProperties": False}}},
    "required": ["count", "events"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, NO_PARAMS, ARRAY_OF_OBJECTS]


def tool_reply(server: str, body: dict, stream: bool) -> tuple[list[tuple[str, str]], str | None, str]:
    """(name, arguments) of each call, the content and the finish_reason, streamed or not."""
    client = client_of(server)
    request = {"model": "SmolLM2-135M-Instruct", "temperature": 0.0, "max_tokens": 120, **body}
    if "structured_outputs" in request:  # vLLM's field: the openai client sends it as an extra
        request["extra_body"] = {"structured_outputs": request.pop("structured_outputs")}
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if call.function.name:  # the call's first delta: its id and name before any arguments
                    assert call.id and call.index not in names and call.index not in arguments
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    return [(names[i], arguments[i]) for i in sorted(names)], content or None, finish


@pytest.mark.slow
@pytest.mark.parametrize("tool", [WEATHER, NO_PARAMS, ARRAY_OF_OBJECTS], ids=["strings", "no-parameters", "array-of-objects"])
def test_a_named_tool_call_streams_the_arguments_it_returns(server: str, tool: dict) -> None:
    body = {"messages": [{"role": "user", "content": "Use the tool."}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": tool["function"]["name"]}}}  # fmt: skip
    calls, content, finish = tool_reply(server, body, stream=False)
    assert [name for name, _ in calls] == [tool["function"]["name"]] and content is None and finish == "tool_calls"
    jsonschema.validate(json.loads(calls[0][1]), tool["function"].get("parameters", {"type": "object"}))
    assert tool_reply(server, body, stream=True) == (calls, content, finish)  # byte for byte


@pytest.mark.slow
def test_required_parallel_calls_and_auto_calls_read_back_alike_streamed_or_not(server: str) -> None:
    required = {"messages": [{"role": "user", "content": "Weather in Paris and in Rome?"}], "tools": TOOLS,
                "tool_choice": "required"}  # fmt: skip
    calls, content, finish = tool_reply(server, required, stream=False)
    assert calls and finish == "tool_calls" and content is None
    for name, arguments in calls:
        [tool] = [t for t in TOOLS if t["function"]["name"] == name]
        jsonschema.validate(json.loads(arguments), tool["function"].get("parameters", {"type": "object"}))
    assert tool_reply(server, required, stream=True) == (calls, content, finish)
    # auto: the reply is read with the hermes parser; a regex makes this small model write two calls.
    two_calls = ('Checking\\.\n<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)", "unit": "c"\\}\\}\n'
                 '</tool_call>\n<tool_call>\n\\{"name": "list_files", "arguments": \\{\\}\\}\n</tool_call>')  # fmt: skip
    auto = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": "auto",
            "structured_outputs": {"regex": two_calls}}  # fmt: skip
    calls, content, finish = tool_reply(server, auto, stream=False)
    assert [name for name, _ in calls] == ["get_weather", "list_files"] and calls[1][1] == "{}"
    assert content == "Checking.\n" and finish == "tool_calls"
    assert tool_reply(server, auto, stream=True) == (calls, content, finish)


def test_tool_history_renders_and_bad_tools_are_400s_naming_the_field(server: str) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]  # fmt: skip
    request = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "tools": TOOLS}
    with_history = httpx.post(f"{server}/v1/chat/completions", json={**request, "messages": history}, timeout=60)
    assert with_history.status_code == 200, with_history.text
    without = httpx.post(f"{server}/v1/chat/completions", json={**request, "messages": history[:1]}, timeout=60).json()
    assert with_history.json()["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 20  # calls and result in the prompt
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [bad_schema]}, "tools.0.function.parameters", "not a valid JSON Schema"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "must match"),
        ({"tool_choice": "required", "tools": None}, "tool_choice", "requires tools"),
    ]
    for extra, param, says in cases:
        body = {**request, "messages": history[:1], **extra}
        response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"], error
