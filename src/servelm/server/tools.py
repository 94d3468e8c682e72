"""OpenAI function tools on /v1/chat/completions: the request's `tools`, `tool_choice` and
`parallel_tool_calls`, the tool-call history in its messages, and how the output is read back.

    tool_choice   output                                  read back as
    none          free text (the tools are still shown)   content
    auto          free text                               --tool-call-parser (tool_parsers.py), else content
    required      JSON held to [{"name", "parameters"}]   those calls (at least one; one unless parallel)
    {function}    JSON held to the function's parameters  one call of that function

`required` and a named function are grammar-constrained (structured outputs), so they always parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import Field

from servelm.sampling_params import StructuredSpec
from servelm.server.errors import bad_request
from servelm.server.structured_request import StrictBody, closed_objects
from servelm.server.tool_parsers import ToolCall, arguments_text, parse_tool_calls

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's rule for a function's name
MAX_TOOLS = 128


class FunctionDefinition(StrictBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object; None: no arguments
    strict: bool | None = None


class ToolDefinition(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: FunctionName


class FunctionCallBody(StrictBody):
    name: Annotated[str, Field(max_length=256)]
    arguments: str  # JSON text, as the assistant message returned it


class ToolCallBody(StrictBody):
    """A call in an assistant message of the history."""

    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCallBody


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolMode:
    """How one request's output is read: `kind` none | auto | required | named (module doc)."""

    kind: str
    function: str | None = None  # named: the function called
    parser: str | None = None  # auto: the tool-call parser (None: no parsing, content only)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output."""
        if self.kind == "named":
            assert self.function is not None
            return None, [ToolCall(self.function, text)]  # the output is the arguments' JSON itself
        if self.kind == "required":
            return None, required_calls(text)
        if self.kind == "auto" and self.parser is not None:
            return parse_tool_calls(self.parser, text)
        return text, []


def required_calls(text: str) -> list[ToolCall]:
    """The calls of a `required` output (a JSON array the grammar held to [{"name", "parameters"}])."""
    try:
        items = json.loads(text)
    except ValueError:
        return []  # cut short by max_tokens: no calls
    return [ToolCall(item["name"], arguments_text(item.get("parameters"))) for item in items if isinstance(item, dict)]


def check_tools(tools: list[ToolDefinition] | None, tool_choice: ToolChoice | None) -> None:
    """400s naming the field: a bad function name or parameters schema, a choice naming no tool."""
    for index, tool in enumerate(tools or []):
        function = tool.function
        if not FUNCTION_NAME.match(function.name):
            raise bad_request(f"tools[{index}]: function name {function.name!r} must match {FUNCTION_NAME.pattern}",
                              param=f"tools.{index}.function.name")  # fmt: skip
        if function.parameters is not None:
            try:
                jsonschema.validators.validator_for(function.parameters).check_schema(function.parameters)
            except jsonschema.SchemaError as exc:
                raise bad_request(f"tools[{index}]: parameters is not a valid JSON Schema: {exc.message}",
                                  param=f"tools.{index}.function.parameters") from exc  # fmt: skip
    if len({tool.function.name for tool in tools or []}) != len(tools or []):
        raise bad_request("tools: function names must be unique", param="tools")
    if tool_choice in ("required",) or isinstance(tool_choice, NamedToolChoice):
        if not tools:
            raise bad_request("tool_choice requires tools", param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        names = [tool.function.name for tool in tools or []]
        if tool_choice.function.name not in names:
            raise bad_request(f"tool_choice names function {tool_choice.function.name!r}, which is not among the "
                              f"tools ({', '.join(names)})", param="tool_choice")  # fmt: skip


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    """The schema a call's arguments are held to: none given is no arguments at all ({}); `strict`
    closes open objects as OpenAI's strict mode does (structured_request.closed_objects)."""
    if function.parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return closed_objects(function.parameters) if function.strict else function.parameters


def tool_mode(tools: list[ToolDefinition] | None, tool_choice: ToolChoice | None, parser: str | None) -> ToolMode:
    if not tools or tool_choice == "none":
        return ToolMode("none")
    if isinstance(tool_choice, NamedToolChoice):
        return ToolMode("named", function=tool_choice.function.name)
    if tool_choice == "required":
        return ToolMode("required")
    return ToolMode("auto", parser=parser)


def tool_spec(mode: ToolMode, tools: list[ToolDefinition] | None, parallel: bool) -> StructuredSpec | None:
    """The grammar a `required` or named tool choice holds the output to (None: free text)."""
    by_name = {tool.function.name: tool.function for tool in tools or []}
    if mode.kind == "named":
        assert mode.function is not None
        return StructuredSpec(kind="json", text=json.dumps(_parameters(by_name[mode.function])))
    if mode.kind != "required":
        return None
    one_call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _parameters(function)},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, function in by_name.items()]  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_call}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredSpec(kind="json", text=json.dumps(schema))


def tools_for_template(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template (or our default tool format) shows them to the model."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
