"""Which streams can be continued on another replica, and the request that continues one.

    client body (completions or chat) + the prompt's ids P + the ids the client already has G
        ─▶ POST /v1/completions {"prompt": P + G, "max_tokens": limit - |G|, the same sampling,
                                 "stream": true, "return_token_ids": true}

The continuation computes P + G as its prompt (a prefill, like a preempted request's recompute)
and samples on from there: a greedy request's next tokens are the ones the lost replica would have
produced. What carries over exactly: temperature, top_p/top_k/min_p, stop strings and ids,
ignore_eos, skip_special_tokens, logprobs, repetition_penalty (it counts prompt and output tokens
alike), priority, cache_salt, speculative, kv_retention; min_tokens less what was generated; a
structured-output constraint (response_format, structured_outputs) with
`servelm.structured_resume_tokens` = |G|, so the new replica's grammar consumes G before it samples
and the constraint goes on from the boundary (scheduler/grammar_waits.py). What
cannot: presence/frequency penalties count only output tokens, so G's tokens stop counting; a seed
restarts its random stream at the boundary (the engine seeds a generator per request and draws once
per token, with no way to skip draws), so it is replaced by seed + |G|: a seeded request stays
reproducible given the same failure, not equal to an undisturbed run.

Not migrated (they fail as before when their replica dies mid-stream): non-streamed requests (no byte
goes out before the whole answer, so the proxy's retry already re-runs them whole), n > 1 and batched
prompts (several interleaved choices), echo (the prompt's text is part of the stream), requests
that carry their own kv_transfer_params, and chat requests with tools the model may call (the
continuation is a completion: the replica's reading of tool calls from the text would be lost).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COMPLETIONS_PATH = "/v1/completions"
INT64_MAX = (1 << 63) - 1
# Copied as they are: the sampling knobs, the scheduling hints and our own options.
_CARRIED = (
    "model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "skip_special_tokens", "priority", "user", "cache_salt", "speculative", "kv_retention", "response_format",
    "structured_outputs",
)  # fmt: skip
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # CompletionRequest's default (an explicit null means the same)


def is_chat(path: str) -> bool:
    return path.endswith("/chat/completions")


def _single_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(t, int) for t in prompt):
        return True
    return len(prompt) == 1 and isinstance(prompt[0], (str, list))


def migratable(path: str, body: Mapping[str, Any]) -> bool:
    """A stream of one choice that the router can continue elsewhere (the module doc says why not others)."""
    if body.get("stream") is not True or body.get("n") not in (None, 1) or body.get("kv_transfer_params"):
        return False
    if calls_tools(body):
        return False
    if is_chat(path):
        return True
    return _single_prompt(body.get("prompt")) and not body.get("echo") and body.get("best_of") in (None, 1)


def calls_tools(body: Mapping[str, Any]) -> bool:
    """Tools the model may call (the module doc says why these are not migrated)."""
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


def is_constrained(body: Mapping[str, Any]) -> bool:
    """A structured-output constraint: its continuation resumes the grammar after the sent tokens."""
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") not in (None, "text"):
        return True
    return bool(body.get("structured_outputs"))


def output_limit(path: str, body: Mapping[str, Any]) -> int | None:
    """The request's max output tokens; None: up to the context window (chat without a limit)."""
    if is_chat(path):
        for key in ("max_completion_tokens", "max_tokens"):
            if isinstance(body.get(key), int):
                return int(body[key])
        return None
    value = body.get("max_tokens")
    return int(value) if isinstance(value, int) else _COMPLETIONS_DEFAULT_MAX_TOKENS


def remaining_tokens(path: str, body: Mapping[str, Any], num_prompt: int, num_sent: int,
                     max_model_len: int | None) -> int:  # fmt: skip
    """Output tokens the continuation may still generate (<= 0: the original hit its limit)."""
    limit = output_limit(path, body)
    if limit is None:
        if max_model_len is None:
            raise ValueError("a request without an output limit needs the replicas' context window")
        limit = max_model_len - num_prompt
    return limit - num_sent


def continuation_body(
    path: str, body: Mapping[str, Any], prompt_ids: list[int], sent_ids: list[int], max_tokens: int
) -> dict[str, Any]:
    """The /v1/completions body that continues `body` after `sent_ids` (max_tokens from remaining_tokens)."""
    continued: dict[str, Any] = {key: body[key] for key in _CARRIED if body.get(key) is not None}
    continued["prompt"] = prompt_ids + sent_ids
    continued["max_tokens"] = max_tokens
    continued["stream"] = True
    continued["return_token_ids"] = True
    if isinstance(body.get("min_tokens"), int):
        continued["min_tokens"] = max(0, min(body["min_tokens"] - len(sent_ids), max_tokens))
    if isinstance(body.get("seed"), int):
        seed = body["seed"] + len(sent_ids)  # a fresh stream per boundary; int64 as the API requires
        continued["seed"] = seed if seed <= INT64_MAX else body["seed"] - len(sent_ids)
    logprobs = body.get("logprobs")
    if is_chat(path):
        logprobs = (body.get("top_logprobs") or 0) if logprobs else None
    if logprobs is not None:
        continued["logprobs"] = logprobs
    if is_constrained(body):
        servelm = body.get("servelm")
        continued["servelm"] = {**(servelm if isinstance(servelm, Mapping) else {}),
                                "structured_resume_tokens": len(sent_ids)}  # fmt: skip
    elif isinstance(body.get("servelm"), Mapping):
        continued["servelm"] = body["servelm"]
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("include_usage"):
        continued["stream_options"] = {"include_usage": True}
    return continued
