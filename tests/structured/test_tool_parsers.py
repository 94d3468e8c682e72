"""Tool calls read back from text: each parser, and streamed in any chunking == read whole."""

from __future__ import annotations

import random

import pytest

from servelm.server.tool_parsers import ToolCallStream, parse_tool_calls

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
          '</tool_call>\n<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>')  # fmt: skip
CASES = [
    ("hermes", HERMES, "Let me check.\n", [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("list_files", "{}")]),
    ("hermes", "No tools needed <tool", "No tools needed <tool", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"a": 1}'), ("g", "{}")]),
    ("llama3_json", "{ this is text", "{ this is text", []),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": "é"}}]', None, [("f", '{"x": "é"}')]),
    ("pythonic", '[f(a=1, b="x"), g()]', None, [("f", '{"a": 1, "b": "x"}'), ("g", "{}")]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_each_parser_reads_calls_or_leaves_text(parser: str, text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse_tool_calls(parser, text)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_in_any_chunks_adds_up_to_the_whole_reading(parser: str, text: str, content: str | None, calls: list):
    rng = random.Random(7)
    for _ in range(20):
        stream, events, i = ToolCallStream(parser), [], 0
        while i < len(text):
            step = rng.randint(1, 8)
            events += stream.feed(text[i : i + step])
            i += step
        events += stream.finish()
        assert [(e.call.name, e.call.arguments) for e in events if e.call] == calls
        assert "".join(e.content for e in events) == (content or "")
