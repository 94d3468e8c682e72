"""Chat messages as a chat template expects them: `{"role", "content"[, "name"]}`, content parts joined
by newlines (as vLLM and llama.cpp join them for a template that takes a string: the same request
renders the same prompt on all three).

The API server builds them from validated ChatMessage models (servelm.server.protocol); the
router from the raw JSON body it forwards untouched (best effort: it only routes on the result,
the replica validates). Both must render the same text or the router's block hashes would
miss the replica's prefix cache, so both go through `template_message`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def content_text(content: str | Sequence[str] | None) -> str:
    """A message's text: a string as is, text parts joined by newlines, none as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(content)


def template_message(role: str, content: str | Sequence[str] | None, name: str | None = None,
                     tool_calls: list[dict[str, Any]] | None = None, tool_call_id: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One message for the chat template; `content` is the text or the texts of its parts;
    `tool_calls` an assistant's calls ({"id", "type", "function": {"name", "arguments"}}) and
    `tool_call_id` a tool result's (tokenization/tool_prompt.py renders both)."""
    entry: dict[str, Any] = {"role": role, "content": content_text(content)}
    if name is not None:
        entry["name"] = name
    if tool_calls:
        entry["tool_calls"] = tool_calls
    if tool_call_id is not None:
        entry["tool_call_id"] = tool_call_id
    return entry


def template_messages_from_json(messages: Any) -> list[dict[str, Any]]:
    """A request body's raw `messages` list as template messages; what is not understood is skipped
    (a role defaults to "user", non-text parts contribute no text)."""
    if not isinstance(messages, list):
        return []
    entries = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = [str(part.get("text", "")) for part in content if isinstance(part, dict)]
        elif not isinstance(content, str):
            content = None
        name, calls, call_id = message.get("name"), message.get("tool_calls"), message.get("tool_call_id")
        entries.append(template_message(
            str(message.get("role", "user")), content, str(name) if name is not None else None,
            [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else None,
            str(call_id) if call_id is not None else None,
        ))  # fmt: skip
    return entries
