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


def template_message(role: str, content: str | Sequence[str] | None, name: str | None = None) -> dict[str, str]:
    """One message for the chat template; `content` is the text or the texts of its parts."""
    entry = {"role": role, "content": content_text(content)}
    if name is not None:
        entry["name"] = name
    return entry


def template_messages_from_json(messages: Any) -> list[dict[str, str]]:
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
        name = message.get("name")
        entries.append(template_message(str(message.get("role", "user")), content, str(name) if name is not None else None))
    return entries
