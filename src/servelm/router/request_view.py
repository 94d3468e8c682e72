"""Turn an OpenAI request body into the RequestView policies route on.

The router tokenizes exactly as the replicas do (servelm.tokenization.prompt_tokenizer's encoder and
chat-template rendering, the same tokenizer files) and hashes full blocks with the
engine's own function, so a prompt's hashes here are the block hashes in the replica's
prefix cache. If they ever disagreed, routing would only get worse, never wrong: the
body is forwarded untouched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import Any

from servelm.kv.block_hash import extra_key_of, hash_block_tokens
from servelm.openai_api.chat_messages import template_messages_from_json
from servelm.router.policies import RequestView
from servelm.tokenization.prompt_tokenizer import PromptTokenizer

SESSION_HEADER = "x-session-id"
# Prompts longer than these are routed on load alone, untokenized and unhashed: tokenizing 4 MiB of
# text takes the router's tokenizer a second or more and ~1M tokens' worth of memory, hashing
# 1M ids ~0.1 s of the event loop, and no context servelm serves holds either (the replica says so).
MAX_ROUTED_PROMPT_CHARS = 4 << 20
MAX_ROUTED_PROMPT_TOKENS = 1 << 20


async def prompt_token_ids(tokenizer: PromptTokenizer, path: str, body: dict[str, Any]) -> list[int]:
    """The (first) prompt's token ids, [] when the body has none we understand or it is too long to route on."""
    if path.endswith("/chat/completions"):
        messages = template_messages_from_json(body.get("messages"))
        if not messages or sum(len(m["content"]) for m in messages) > MAX_ROUTED_PROMPT_CHARS:
            return []
        tools = body.get("tools")  # rendered into the prompt as the replica renders them (tool_prompt.py)
        tools = [t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else None
        return await tokenizer.apply_chat_template(messages, bool(body.get("add_generation_prompt", True)), tools)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route on its first prompt (they usually share the prefix)
    if isinstance(prompt, str) and len(prompt) <= MAX_ROUTED_PROMPT_CHARS:
        return (await tokenizer.encode_many([prompt]))[0]
    if isinstance(prompt, list) and len(prompt) <= MAX_ROUTED_PROMPT_TOKENS and all(isinstance(t, int) for t in prompt):
        return prompt
    return []


def is_single_generation(body: dict[str, Any]) -> bool:
    """One prompt (not a batch), one choice, and no prompt logprobs to compute (echo + logprobs,
    or max_tokens 0 scoring the prompt): what a prefill/decode split can hand off whole."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1:
        return False
    n = body.get("n", 1)
    scores_prompt = bool(body.get("echo")) and (body.get("logprobs") is not None or body.get("max_tokens") == 0)
    return (n is None or n == 1) and not scores_prompt


def _max_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 16


async def build_view(
    tokenizer: PromptTokenizer | None, block_size: int, path: str, body: dict[str, Any], headers: dict[str, str],
    adapter_names: Collection[str] = (),
) -> RequestView:
    """The RequestView of a parsed body. No tokenizer: no hashes (the cache-blind policies need none).
    `adapter_names`: the LoRA adapters the replicas serve (a `model` naming one runs it)."""
    token_ids: list[int] = []
    if tokenizer is not None:
        try:
            token_ids = await prompt_token_ids(tokenizer, path, body)
        except (ValueError, TypeError, KeyError):
            token_ids = []  # the replica will reject the request with a proper error
    salt = body.get("cache_salt")
    model = body.get("model")
    lora_name = model if isinstance(model, str) and model in adapter_names else None
    # A salted request, or one of an adapter, hashes into its own namespace on the replica: the same here.
    block_hashes = hash_block_tokens(token_ids, block_size, extra_key_of(salt if isinstance(salt, str) else None, lora_name))
    routing_key = block_hashes[0] if block_hashes else hashlib.sha256(repr(token_ids or body).encode()).digest()
    user = body.get("user")
    session_id = headers.get(SESSION_HEADER) or (user if isinstance(user, str) and user else None)
    return RequestView(
        block_hashes=block_hashes,
        num_prompt_tokens=len(token_ids),
        num_output_tokens=_max_tokens(body),
        session_id=session_id,
        routing_key=routing_key,
        single_generation=is_single_generation(body),
        lora_name=lora_name,
    )
