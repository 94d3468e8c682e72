"""Tool calls read back from generated text (`--tool-call-parser`, vLLM's names), whole or streamed.

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one block per call
                 (our default tool format, tokenization/tool_prompt.py; Qwen 2.5, Hermes)
    llama3_json  {"name": "f", "parameters": {...}}, calls separated by ";" (optionally <|python_tag|> first)
    mistral      [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]
    pythonic     [f(a=1, b="x"), g()]  (Llama 3.2 / 4)

A call's `arguments` is always json.dumps of the arguments object the model wrote, computed by the
same function whether the response streams or not: the streamed pieces of a call concatenate to the
non-streamed arguments byte for byte (the complaint vLLM's users have of partial-JSON streaming).
Streaming emits content until a call may begin, then each call (id and name first, then its
arguments) once its text is complete: hermes block by block, the others at the end of the output.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def arguments_text(arguments: Any) -> str:
    """The one serialisation of a call's arguments (module doc: streamed == non-streamed)."""
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def _call_from(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("parameters", obj.get("arguments")))
    if arguments is not None and not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], arguments_text(arguments))


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in `text`, separated by whitespace or ';'; None if anything else is there."""
    decoder, values, i = json.JSONDecoder(), list[Any](), 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def parse_hermes_block(block: str) -> ToolCall | None:
    try:
        return _call_from(json.loads(block))
    except ValueError:
        return None


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; text that holds no well-formed call is all content."""
    if parser == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        calls, rest = [], text[start:]
        while rest.startswith(HERMES_OPEN):
            end = rest.find(HERMES_CLOSE)
            body = rest[len(HERMES_OPEN) : end if end >= 0 else len(rest)]
            call = parse_hermes_block(body)
            if call is None:
                return text, []
            calls.append(call)
            rest = rest[end + len(HERMES_CLOSE) :].lstrip() if end >= 0 else ""
        content = text[:start]
        return content if content.strip() else None, calls
    stripped = text.strip()
    if parser == "llama3_json":
        body = stripped.removeprefix(PYTHON_TAG).lstrip()
        values = _json_values(body) if body.startswith("{") else None
        calls = [c for c in (_call_from(v, "parameters") for v in values or []) if c is not None]
        return (None, calls) if values and len(calls) == len(values) else (text, [])
    if parser == "mistral":
        if not stripped.startswith(MISTRAL_TAG):
            return text, []
        values = _json_values(stripped[len(MISTRAL_TAG) :])
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
        calls = [c for c in (_call_from(v) for v in items or []) if c is not None]
        return (None, calls) if items and len(calls) == len(items) else (text, [])
    if parser == "pythonic":
        return (None, calls) if (calls := _pythonic_calls(stripped)) else (text, [])
    raise ValueError(f"unknown tool call parser {parser!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")


def _pythonic_calls(text: str) -> list[ToolCall]:
    if not (text.startswith("[") and text.endswith("]")):
        return []
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List):
            return []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return []
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            calls.append(ToolCall(node.func.id, arguments_text(arguments)))
        return calls
    except (SyntaxError, ValueError):
        return []


def could_begin_call(parser: str, text: str) -> bool:
    """May `text` (the output so far, stripped at the start) still turn out to be a tool call?"""
    head = text.lstrip()
    marker = {"llama3_json": ("{", PYTHON_TAG), "mistral": (MISTRAL_TAG,), "pythonic": ("[",)}[parser]
    return any(m.startswith(head[: len(m)]) for m in marker) if head else True


@dataclass
class StreamEvent:
    content: str = ""  # text for the message's content
    call: ToolCall | None = None  # a complete call: sent as its name chunk, then its arguments


@dataclass
class ToolCallStream:
    """One choice's streamed output read as content and tool calls (module doc)."""

    parser: str
    _held: str = ""  # text not yet emitted: a possible start of a call, or a call in progress
    _in_calls: bool = False  # hermes: a <tool_call> block began; content is over
    _whole: str = ""  # other parsers: the output so far, while it may be a call
    _undecided: bool = True
    num_calls: int = 0

    def buffer(self, text: str) -> str:
        """Keep `text` back whole (a reply read only at its end); the output so far."""
        self._whole += text
        return self._whole

    def count(self, num_calls: int) -> None:
        self.num_calls += num_calls

    def feed(self, text: str) -> list[StreamEvent]:
        if self.parser == "hermes":
            return self._feed_hermes(text)
        self._whole += text
        if self._undecided:
            if could_begin_call(self.parser, self._whole):
                return []
            self._undecided = False
            text, self._whole = self._whole, ""
        return [StreamEvent(content=text)] if text else []

    def finish(self) -> list[StreamEvent]:
        if self.parser == "hermes":
            events = []
            if self._held and self._in_calls:  # a block the output ended inside of
                call = parse_hermes_block(self._held.removeprefix(HERMES_OPEN).split(HERMES_CLOSE)[0])
                events.append(StreamEvent(call=call) if call is not None else StreamEvent(content=self._held))
            elif self._held:
                events.append(StreamEvent(content=self._held))
            self._held = ""
            return self._counted(events)
        if not self._undecided:
            return []
        content, calls = parse_tool_calls(self.parser, self._whole)
        self._whole = ""
        events = [StreamEvent(call=call) for call in calls] if calls else [StreamEvent(content=content or "")]
        return self._counted([e for e in events if e.call is not None or e.content])

    def _feed_hermes(self, text: str) -> list[StreamEvent]:
        self._held += text
        events: list[StreamEvent] = []
        while True:
            if not self._in_calls:
                start = self._held.find(HERMES_OPEN)
                if start < 0:  # keep back a tail that may be the start of "<tool_call>"
                    keep = next((k for k in range(min(len(HERMES_OPEN) - 1, len(self._held)), 0, -1)
                                 if HERMES_OPEN.startswith(self._held[-k:])), 0)  # fmt: skip
                    emit, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                    if emit:
                        events.append(StreamEvent(content=emit))
                    return self._counted(events)
                if self._held[:start]:
                    events.append(StreamEvent(content=self._held[:start]))
                self._held, self._in_calls = self._held[start:], True
            self._held = self._held.lstrip()  # between calls: whitespace, as the whole parse skips it
            if not self._held.startswith(HERMES_OPEN[: len(self._held)]):
                self._held = ""  # text after the calls: dropped, as the non-streamed parse drops it
            end = self._held.find(HERMES_CLOSE)
            if end < 0:
                return self._counted(events)
            call = parse_hermes_block(self._held[len(HERMES_OPEN) : end])
            # A block that is no call stays text, as a whole reply of only such blocks reads (one
            # after a good call cannot take that call back: the one case the two readings differ).
            events.append(StreamEvent(call=call) if call is not None else StreamEvent(content=self._held[: end + len(HERMES_CLOSE)]))
            self._held = self._held[end + len(HERMES_CLOSE) :]

    def _counted(self, events: list[StreamEvent]) -> list[StreamEvent]:
        self.num_calls += sum(1 for e in events if e.call is not None)
        return events
