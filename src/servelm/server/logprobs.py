"""Logprobs in OpenAI's two response shapes.

/v1/completions (also what lm-evaluation-harness reads for loglikelihood):
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...], "text_offset": [...]}
  with echo, the prompt's tokens come first and the first of them has null logprobs
  (nothing precedes it). Like vLLM, each top dict also holds the chosen token, so
  `token_logprob == max(top.values())` says whether the choice was greedy.

/v1/chat/completions:
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

Token strings are each token decoded alone; callers decode the ids `ids_to_decode()` lists
(in the thread pool when there are many, e.g. a long echoed prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from servelm.datatypes import PositionLogprobs


def ids_to_decode(token_ids: Sequence[int], entries: Sequence[PositionLogprobs | None]) -> list[int]:
    """Every id whose string the formatted logprobs show: the tokens and their top alternatives."""
    ids = set(token_ids)
    for entry in entries:
        if entry is not None:
            ids.add(entry.chosen.token_id)
            ids.update(t.token_id for t in entry.top)
    return sorted(ids)


def empty_completion_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def extend_completion_logprobs(
    target: dict[str, list[Any]],
    token_ids: Sequence[int],
    entries: Sequence[PositionLogprobs | None],
    strings: dict[int, str],
    text_offset: int,
) -> int:
    """Append one span of tokens to a completions logprobs dict; return the text offset after it."""
    for position, token_id in enumerate(token_ids):
        entry = entries[position] if position < len(entries) else None
        text = strings[token_id]
        target["tokens"].append(text)
        target["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            target["token_logprobs"].append(None)
            target["top_logprobs"].append(None)
            continue
        target["token_logprobs"].append(entry.chosen.logprob)
        top = {strings[t.token_id]: t.logprob for t in entry.top}
        top.setdefault(strings[entry.chosen.token_id], entry.chosen.logprob)
        target["top_logprobs"].append(top)
    return text_offset


def chat_logprobs_content(
    token_ids: Sequence[int],
    entries: Sequence[PositionLogprobs],
    strings: dict[int, str],
    raw_bytes: dict[int, bytes],
    num_top: int,
) -> list[dict[str, Any]]:
    """`raw_bytes`: each id's own bytes (a token holding part of a character shows "\ufffd" as its
    string; its bytes are what joins back into the text)."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        content.append(
            {
                "token": strings[token_id],
                "logprob": entry.chosen.logprob,
                "bytes": list(raw_bytes[token_id]),
                "top_logprobs": [
                    {"token": strings[t.token_id], "logprob": t.logprob, "bytes": list(raw_bytes[t.token_id])}
                    for t in entry.top[:num_top]
                ],
            }
        )
    return content
