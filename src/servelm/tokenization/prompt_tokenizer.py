"""Tokenization off the event loop.

Encoding a long prompt takes milliseconds per 10k characters (about 125 ms for 100k here)
and a chat template is a Jinja render: on the event loop either would freeze every other
client's stream for that long. Both run in a small thread pool instead. A thread is
enough because the Hugging Face fast tokenizer's batch encoder releases the GIL while it
works in Rust (measured: a 1 ms ticker on another thread keeps ticking through a 125 ms
encode; the single-text `Tokenizer.encode` does NOT release it, so we never call that).
See FastEncoder for the faster batch call we use when it is equivalent.

Detokenizing one step of one stream (two decodes of a ~6-token window) costs ~15 µs and
stays inline in the request's coroutine: a thread hop would cost more than the work. The
detokenizer gets `FastDecoder`, which calls the Rust decoder directly (3x cheaper than
going through transformers) when that is provably equivalent for this tokenizer.
Bulk decoding (echo of a long prompt, per-token strings for logprobs) goes to the pool.

Short inputs (up to INLINE_MAX_CHARS) are encoded inline: that takes at most ~1 ms here, less
than a pool call's two thread hand-offs cost on a busy machine (the worker must win the GIL
from a loop that is busy streaming), and it is bounded.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from servelm.tokenization.chat_roles import developer_as_system
from servelm.tokenization.token_bytes import TokenBytes
from servelm.tokenization.tool_prompt import with_tools

INLINE_MAX_CHARS = 2048
_PROBE_TEXT = "Hello, world! Ünïcödé ✓ 12345 \n\t  spaces  <|im_end|> 日本語"


class FastDecoder:
    """`decode(ids, skip_special_tokens)` for IncrementalDetokenizer, through the Rust backend when safe."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is not None and not self._matches_transformers():
            self._backend = None
        self._token_bytes: TokenBytes | None = None  # made at the first logprobs request that needs it

    def _matches_transformers(self) -> bool:
        # clean_up_tokenization_spaces and friends live in transformers only: compare on a probe.
        ids = self.tokenizer.encode(_PROBE_TEXT, add_special_tokens=False)
        return all(
            self._backend.decode(ids[:k], skip_special_tokens=skip) == self.tokenizer.decode(ids[:k], skip_special_tokens=skip)
            for k in (1, 3, len(ids))
            for skip in (True, False)
        )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (what logprobs responses show), decoded one by one."""
        if self._backend is not None:
            return self._backend.decode_batch([[i] for i in token_ids], skip_special_tokens=False)
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in token_ids]

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's raw bytes (chat logprobs' `bytes`: a token holding part of a character has
        its bytes, not U+FFFD's); servelm.tokenization.token_bytes."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer, lambda i: self.token_strings([i])[0])
        return self._token_bytes.of(token_ids)


class FastEncoder:
    """`encode(text, add_special_tokens)` through the Rust backend's `encode_batch_fast` when it gives
    transformers' ids: it skips character offsets, so it is ~2.5x faster and holds the GIL for only
    a few ms per 100k tokens (building the id list), against ~30 ms for transformers' path."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._batch: Any = getattr(backend, "encode_batch_fast", None)
        if self._batch is not None and not all(
            self._encode_fast(_PROBE_TEXT, special) == list(tokenizer.encode(_PROBE_TEXT, add_special_tokens=special))
            for special in (True, False)
        ):
            self._batch = None

    def _encode_fast(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._batch is not None:
            return self._encode_fast(text, add_special_tokens)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))


class PromptTokenizer:
    """Async tokenization, chat templating and bulk decoding on a private thread pool."""

    def __init__(self, tokenizer: Any, max_workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.decoder = FastDecoder(tokenizer)
        self.encoder = FastEncoder(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="servelm-tokenize")
        self.num_pending = 0  # calls submitted and not finished: counted as waiting by admission

    async def _run(self, fn: Any, *args: Any) -> Any:
        self.num_pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.num_pending -= 1

    async def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if sum(len(t) for t in texts) <= INLINE_MAX_CHARS:
            return [self._encode(t, add_special_tokens) for t in texts]
        return await self._run(lambda: [self._encode(t, add_special_tokens) for t in texts])

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                                  tools: list[dict[str, Any]] | None = None) -> list[int]:  # fmt: skip
        """The prompt's ids; `tools` (OpenAI's function tools) and tool-call history rendered as
        tool_prompt.py says."""
        if sum(len(m["content"] or "") for m in messages) <= INLINE_MAX_CHARS and not tools:
            return self._render_chat(messages, add_generation_prompt, tools)
        return await self._run(self._render_chat, messages, add_generation_prompt, tools)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._run(lambda: self.decoder.decode(token_ids, skip_special_tokens=skip_special_tokens))

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        return await self._run(self.decoder.token_strings, token_ids)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encoder.encode(text, add_special_tokens=add_special_tokens)

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None) -> list[int]:  # fmt: skip
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        messages, template_tools = with_tools(messages, tools, self.tokenizer.chat_template)
        messages = developer_as_system(messages, self.tokenizer.chat_template)
        text = self.tokenizer.apply_chat_template(messages, tools=template_tools, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)  # fmt: skip
        # The template writes any BOS itself: encoding must not add another.
        return self.encoder.encode(text, add_special_tokens=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
