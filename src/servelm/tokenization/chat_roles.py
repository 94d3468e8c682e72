"""OpenAI's `developer` role for chat templates that do not know it.

In OpenAI's API a developer message is the system instructions (newer models take `developer`
where older ones took `system`). A model trained on `system` only, rendered by a template that
writes any role as is (SmolLM2's, ChatML's), would see an unknown `developer` turn, and the template
would add its own default system prompt in front, since the first message is not a system one.
So, for a template that never names `developer`, developer messages are system messages, and all
system messages become one at the start, their texts joined by a blank line: the conversation a
`system`-only model expects. vLLM renders them the same way, so one request gives one prompt on both.
"""

from __future__ import annotations

_SYSTEM_ROLES = ("system", "developer")


def template_knows_developer(chat_template: str | dict[str, str]) -> bool:
    """The template names the role (as a quoted string: a comparison or a mapping key); a
    tokenizer's named templates are searched all."""
    text = chat_template if isinstance(chat_template, str) else " ".join(chat_template.values())
    return '"developer"' in text or "'developer'" in text


def developer_as_system(messages: list[dict[str, str]], chat_template: str | dict[str, str]) -> list[dict[str, str]]:
    """`messages` as the template should see them (see the module docstring); unchanged when
    there is no developer message or the template has the role."""
    if not any(m.get("role") == "developer" for m in messages) or template_knows_developer(chat_template):
        return messages
    instructions = [m.get("content") or "" for m in messages if m.get("role") in _SYSTEM_ROLES]
    rest = [m for m in messages if m.get("role") not in _SYSTEM_ROLES]
    return [{"role": "system", "content": "\n\n".join(text for text in instructions if text)}, *rest]
