"""The prompt forms the offline `LLM.generate` accepts (vLLM's), parsed and type-checked before
anything reaches the engine:

    "text"                          one text prompt
    [1, 2, 3]                       one prompt of token ids
    {"prompt": "text"}              vLLM's TextPrompt
    {"prompt_token_ids": [1, 2]}    vLLM's TokensPrompt
    a list or tuple of the above    several prompts (a flat list of ints is one prompt)

Anything else is a TypeError / ValueError naming the prompt's index and what was wrong: a dict
must never be iterated as if it were token ids. Id ranges are checked by the caller, which
knows the vocabulary.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptInput = str | Sequence[int] | TextPrompt | TokensPrompt


@dataclass(frozen=True)
class ParsedPrompt:
    text: str | None  # the text, when the prompt was given as text (to be tokenized)
    token_ids: list[int] | None  # the ids, when given as ids (plain Python ints)


def parse_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[ParsedPrompt]:
    """Every prompt of `prompts`, in order. Raises TypeError/ValueError for a malformed one."""
    if isinstance(prompts, (str, dict)):
        return [_parse_one(prompts, 0)]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a dict or a list of prompts, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    if all(_is_token_id(p) for p in prompts):
        return [_parse_one(prompts, 0)]  # one prompt given as ids
    return [_parse_one(prompt, index) for index, prompt in enumerate(prompts)]


def _parse_one(prompt: Any, index: int) -> ParsedPrompt:
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return ParsedPrompt(prompt["prompt"], None)
        if keys == {"prompt_token_ids"}:
            return ParsedPrompt(None, _token_ids(prompt["prompt_token_ids"], index))
        raise ValueError(
            f"prompt {index}: a dict prompt must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, "
            f"got keys {sorted(map(str, keys))}"
        )
    if isinstance(prompt, (list, tuple)):
        return ParsedPrompt(None, _token_ids(prompt, index))
    raise TypeError(f"prompt {index}: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _token_ids(ids: Any, index: int) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"prompt {index}: prompt_token_ids must be a list of ints, got {type(ids).__name__}")
    bad = next((t for t in ids if not _is_token_id(t)), None)
    if bad is not None:
        raise TypeError(f"prompt {index}: token ids must be ints, got {bad!r} ({type(bad).__name__})")
    return [operator.index(t) for t in ids]


def _is_token_id(value: Any) -> bool:
    """An int or an integer scalar (numpy, torch 0-d), never a bool."""
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True
