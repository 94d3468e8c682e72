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
    lora_name_of,
    render_chat,
    reserve_tokens,
    respond,
    sse,
    stream_tail,
    tenant_priority,
    usage,
)  # fmt: skip
from servelm.server.tool_parsers import StreamEvent, ToolCall, ToolCallStream
from servelm.server.tools import ToolMode


async def create_chat_completion(ctx: ServerContext, http_request: Request, body: ChatCompletionRequest) -> Response:
    request_id, timeline, params = begin_request(ctx, http_request, "chatcmpl", body)
    await ctx.structured.check(params.structured, body.structured_param)
    kv_transfer = kv_transfer_for(ctx.kv_transfer, body.kv_transfer_params, body.n)
    messages = body.chat_messages()
    ctx.prompt_limits.check_messages([m["content"] for m in messages])  # before the template renders them
    ctx.admission.admit(body.n)
    prompt = await render_chat(ctx, messages, body.add_generation_prompt, body.template_tools)
    check_prompts(ctx, [prompt], params, "messages", completion_param=body.max_tokens_param)
    timeline.stamp(ApiStamp.TOKENIZED)
    priority, slo = tenant_priority(http_request, body.priority, body.kv_retention)
    request = GenerationRequest(
        request_id, [prompt], params, timeline, priority, body.cache_salt, slo, kv_transfer=kv_transfer,
        lora_name=lora_name_of(ctx, body.model),
    )
    gen = ctx.engine.generate(request, observer=ctx.metrics)
    reserve_tokens(http_request, gen, ctx.max_model_len)
    view = _ChatView(ctx, body, gen, body.tool_mode(ctx.tool_call_parser))
    return await respond(http_request, gen, view, body.stream)


@dataclass
class _ChatView:
    ctx: ServerContext
    body: ChatCompletionRequest
    gen: GenerationStream
    tools: ToolMode  # how the reply is read: content, or tool calls (tools.py)
    created: int = field(default_factory=lambda: int(time.time()))
    _tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)  # per choice, while streaming
    _named_started: set[int] = field(default_factory=set)  # choices whose named call's id and name went out

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
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts[choice.index])}
            finish_reason = state.finish_reason if state else None
            if self.tools.kind != "none":
                content, calls = self.tools.read(message["content"])
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choices.append(
                {
                    "index": choice.index,
                    "message": message,
                    "logprobs": self._logprobs(tokens[choice.index], entries[choice.index]),
                    "finish_reason": finish_reason,
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
                    chunk = sse({**header, "choices": entries, **prompt_ids})  # the prompt's ids: first chunk only
                    prompt_ids = {}
                    if any(d.token_ids for d in deltas):
                        self.gen.timeline.stamp(ApiStamp.FIRST_BYTE_WRITTEN)  # before the hand-off: see ApiStamp
                    yield chunk
            body = self.body
            for event in stream_tail(self.ctx, self.gen, header, body.include_usage, body.wants_timeline,
                                     len(self.gen.prompts[0]), completion_tokens):  # fmt: skip
                yield event
        finally:
            self.gen.close()

    def _stream_entry(self, delta: ChoiceDelta, started: set[int]) -> dict[str, Any] | None:
        message: dict[str, Any] = {}
        if delta.choice.index not in started:
            started.add(delta.choice.index)
            message["role"] = "assistant"  # the first chunk of each choice names the role
        finish_reason = delta.finish_reason
        if self.tools.kind != "none":
            text, calls, finish_reason = self._tool_deltas(delta)
            if text or "role" in message:
                message["content"] = text
            if calls:
                message["tool_calls"] = calls
        elif delta.text or "role" in message:
            message["content"] = delta.text
        logprobs = self._logprobs(delta.token_ids, delta.logprobs or [])
        with_ids = self.body.return_token_ids  # then a delta whose text is held back still carries its ids
        if not message and logprobs is None and finish_reason is None and not (with_ids and delta.token_ids):
            return None
        entry = {"index": delta.choice.index, "delta": message, "logprobs": logprobs,
                 "finish_reason": finish_reason, "stop_reason": delta.stop_reason}  # fmt: skip
        if with_ids:
            entry["token_ids"] = delta.token_ids
        return entry

    def _tool_deltas(self, delta: ChoiceDelta) -> tuple[str, list[dict[str, Any]], str | None]:
        """A delta of a tool-reading reply: (content text, OpenAI tool_calls deltas, finish_reason).
        A named function streams its arguments as generated; the other modes emit each call whole
        once its text is complete (tool_parsers.py: the pieces add up to the non-streamed ones)."""
        index = delta.choice.index
        if self.tools.kind == "named":
            calls = []
            if index not in self._named_started:  # its first delta: the call's id and name
                self._named_started.add(index)
                call = ToolCall(self.tools.function or "", "")
                calls.append({"index": 0, **call.as_openai()})
            if delta.text:
                calls.append({"index": 0, "function": {"arguments": delta.text}})
            return "", calls, "tool_calls" if delta.finish_reason == "stop" else delta.finish_reason
        stream = self._tool_streams.setdefault(index, ToolCallStream(self.tools.parser or "hermes"))
        if self.tools.kind == "required":  # read at the end: the JSON array whole
            whole = stream.buffer(delta.text)
            events = [StreamEvent(call=c) for c in self.tools.read(whole)[1]] if delta.finish_reason else []
            stream.count(len(events))
        elif self.tools.parser is None:
            events = [StreamEvent(content=delta.text)]
        else:
            events = stream.feed(delta.text) + (stream.finish() if delta.finish_reason else [])
        text = "".join(e.content for e in events)
        calls, first = [], stream.num_calls - sum(1 for e in events if e.call is not None)
        for event in events:
            if event.call is not None:
                calls.append({"index": first, **{**event.call.as_openai(), "function": {"name": event.call.name,
                                                                                         "arguments": ""}}})  # fmt: skip
                calls.append({"index": first, "function": {"arguments": event.call.arguments}})
                first += 1
        finish_reason = delta.finish_reason
        if finish_reason == "stop" and stream.num_calls:
            finish_reason = "tool_calls"
        return text, calls, finish_reason
