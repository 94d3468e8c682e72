"""POST /v1/chat/completions: messages → the model's chat template → tokens → an assistant reply."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from servelm.engine.async_llm import GenerationRequest, GenerationStream
from servelm.engine.fan_out import ChoiceDelta
from servelm.obs.timeline import ApiStamp
from servelm.server.context import ServerContext
from servelm.server.kv_transfer_api import kv_transfer_for
from servelm.server.logprobs import chat_logprobs_content, ids_to_decode
from servelm.server.protocol import ChatCompletionRequest
from servelm.server.serving import (
    api_error_from_engine,
    begin_request,
    check_prompts,
    engine_error,
    finish_request,
    json_response,
    render_chat,
    reserve_tokens,
    respond,
    sse,
    stream_tail,
    tenant_priority,
    usage,
)  # fmt: skip


async def create_chat_completion(ctx: ServerContext, http_request: Request, body: ChatCompletionRequest) -> Response:
    request_id, timeline, params = begin_request(ctx, http_request, "chatcmpl", body)
    await ctx.structured.check(params.structured, body.structured_param)
    kv_transfer = kv_transfer_for(ctx.kv_transfer, body.kv_transfer_params, body.n)
    messages = body.chat_messages()
    ctx.prompt_limits.check_messages([m["content"] for m in messages])  # before the template renders them
    ctx.admission.admit(body.n)
    prompt = await render_chat(ctx, messages, body.add_generation_prompt)
    check_prompts(ctx, [prompt], params, "messages", completion_param=body.max_tokens_param)
    timeline.stamp(ApiStamp.TOKENIZED)
    priority, slo = tenant_priority(http_request, body.priority, body.kv_retention)
    request = GenerationRequest(
        request_id, [prompt], params, timeline, priority, body.cache_salt, slo, kv_transfer=kv_transfer
    )
    gen = ctx.engine.generate(request, observer=ctx.metrics)
    reserve_tokens(http_request, gen, ctx.max_model_len)
    return await respond(http_request, gen, _ChatView(ctx, body, gen), body.stream)


@dataclass
class _ChatView:
    ctx: ServerContext
    body: ChatCompletionRequest
    gen: GenerationStream
    created: int = field(default_factory=lambda: int(time.time()))

    def _header(self, obj: str) -> dict[str, Any]:
        return {"id": self.gen.request_id, "object": obj, "created": self.created, "model": self.ctx.model_name,
                "system_fingerprint": None}  # fmt: skip

    def _logprobs(self, token_ids: list[int], entries: list) -> dict[str, Any] | None:
        if not self.body.logprobs or not token_ids:
            return None
        ids = ids_to_decode(token_ids, entries)
        decoder = self.ctx.tokenizer.decoder
        strings = dict(zip(ids, decoder.token_strings(ids)))
        raw_bytes = dict(zip(ids, decoder.token_bytes(ids)))
        return {
            "content": chat_logprobs_content(token_ids, entries, strings, raw_bytes, self.body.top_logprobs or 0),
            "refusal": None,
        }

    async def collect(self) -> Response:
        texts: dict[int, list[str]] = {c.index: [] for c in self.gen.choices}
        tokens: dict[int, list[int]] = {c.index: [] for c in self.gen.choices}
        entries: dict[int, list] = {c.index: [] for c in self.gen.choices}
        async for deltas in self.gen.deltas():
            for delta in deltas:
                texts[delta.choice.index].append(delta.text)
                tokens[delta.choice.index].extend(delta.token_ids)
                entries[delta.choice.index].extend(delta.logprobs or [])
        if engine_error(self.gen) is not None:
            raise api_error_from_engine(self.gen)
        choices = []
        for choice in self.gen.choices:
            state = choice.state
            choices.append(
                {
                    "index": choice.index,
                    "message": {"role": "assistant", "content": "".join(texts[choice.index])},
                    "logprobs": self._logprobs(tokens[choice.index], entries[choice.index]),
                    "finish_reason": state.finish_reason if state else None,
                    "stop_reason": state.stop_reason if state else None,
                }
            )
        prompt_tokens, completion_tokens = len(self.gen.prompts[0]), sum(len(t) for t in tokens.values())
        done = finish_request(self.ctx, self.gen, prompt_tokens, completion_tokens, self.body.wants_timeline)
        payload = {
            **self._header("chat.completion"),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, self.gen.num_cached_prompt_tokens),
        }
        if self.body.return_token_ids:  # vLLM's shape: the prompt's ids on the response, new ids per choice
            payload["prompt_token_ids"] = self.gen.prompts[0]
            for choice, entry in zip(self.gen.choices, choices):
                entry["token_ids"] = tokens[choice.index]
        if done.timeline_dict is not None:
            payload["servelm"] = {"timeline": done.timeline_dict}
        return json_response(payload, headers=done.ttft_header)

    async def stream(self) -> AsyncIterator[bytes]:
        header = self._header("chat.completion.chunk")
        if self.body.include_usage:
            header["usage"] = None
        started: set[int] = set()
        completion_tokens = 0
        prompt_ids = {"prompt_token_ids": self.gen.prompts[0]} if self.body.return_token_ids else {}
        try:
            async for deltas in self.gen.deltas():
                entries = [e for e in (self._stream_entry(d, started) for d in deltas) if e is not None]
                completion_tokens += sum(len(d.token_ids) for d in deltas)
                if entries:
                    yield sse({**header, "choices": entries, **prompt_ids})  # the prompt's ids: first chunk only
                    prompt_ids = {}
                    if any(d.token_ids for d in deltas):
                        self.gen.timeline.stamp(ApiStamp.FIRST_BYTE_WRITTEN)
            body = self.body
            for event in stream_tail(self.ctx, self.gen, header, body.include_usage, body.wants_timeline,
                                     len(self.gen.prompts[0]), completion_tokens):  # fmt: skip
                yield event
        finally:
            self.gen.close()

    def _stream_entry(self, delta: ChoiceDelta, started: set[int]) -> dict[str, Any] | None:
        message: dict[str, str] = {}
        if delta.choice.index not in started:
            started.add(delta.choice.index)
            message["role"] = "assistant"  # the first chunk of each choice names the role
        if delta.text or "role" in message:
            message["content"] = delta.text
        logprobs = self._logprobs(delta.token_ids, delta.logprobs or [])
        with_ids = self.body.return_token_ids  # then a delta whose text is held back still carries its ids
        if not message and logprobs is None and delta.finish_reason is None and not (with_ids and delta.token_ids):
            return None
        entry = {"index": delta.choice.index, "delta": message, "logprobs": logprobs,
                 "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}  # fmt: skip
        if with_ids:
            entry["token_ids"] = delta.token_ids
        return entry
