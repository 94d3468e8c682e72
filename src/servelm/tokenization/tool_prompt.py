"""Tools and tool-call history in a chat prompt: through the model's own chat template when it
takes `tools`, else through our default tool format (Hermes-style, documented in the README).

    default format, what the model sees:
      system:    <the request's system text>\\n\\n<TOOLS_PREAMBLE with one JSON function per line>
      assistant: <content>\\n<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (one block per call)
      tool:      rendered as a user turn: <tool_response>\\n<content>\\n</tool_response>

The default format is the one the `hermes` tool-call parser reads back (openai_api/tool_parsers.py).
The API server and the router render through here alike, so the router's block hashes cover the
rendered tools.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


def template_takes_tools(chat_template: str | dict[str, str] | None) -> bool:
    """Does the model's chat template render `tools` itself (Llama 3.1, Qwen 2.5, Hermes, Mistral...)?"""
    texts = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return any("tools" in text for text in texts)


def _arguments_object(arguments: Any) -> Any:
    """A history tool call's arguments (OpenAI sends a JSON string) as the object they encode."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    return [call.get("function", {}) for call in calls if isinstance(call, dict)]


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               chat_template: str | dict[str, str] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:  # fmt: skip
    """(messages, tools) as the chat template is to be called with: unchanged without tools or tool
    history; the template's own rendering where it takes tools; else the default format (module doc)
    in plain text messages and no `tools` argument."""
    has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not tools and not has_history:
        return messages, None
    if template_takes_tools(chat_template):
        native = []
        for message in messages:
            if message.get("tool_calls"):
                message = {**message, "tool_calls": [
                    {"type": "function", "function": {"name": f.get("name"), "arguments": _arguments_object(f.get("arguments"))}}
                    for f in _calls(message)]}  # fmt: skip
            native.append(message)
        return native, list(tools) if tools else None
    rendered: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif message.get("tool_calls"):
            blocks = [
                "<tool_call>\n" + json.dumps({"name": f.get("name"), "arguments": _arguments_object(f.get("arguments"))},
                                             ensure_ascii=False) + "\n</tool_call>"
                for f in _calls(message)
            ]  # fmt: skip
            rendered.append({"role": role, "content": "\n".join([content, *blocks] if content else blocks)})
        else:
            rendered.append({"role": role, "content": content})
    if tools:
        # Nulls dropped and keys sorted: the API server (from validated models) and the router (from
        # the raw body) render the same text, whatever order or explicit nulls the client sent.
        block = TOOLS_PREAMBLE.format(
            tools="\n".join(json.dumps(_without_nulls(tool), ensure_ascii=False, sort_keys=True) for tool in tools)
        )
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{block}".lstrip()}
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered, None
