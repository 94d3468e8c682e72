"""POST /v1/completions: prompt(s) as text or token ids → text, streamed or whole.

echo + logprobs returns the prompt's tokens with their logprobs before the generated ones
(the first prompt token has none); with max_tokens 0 only the prompt is scored — the engine
runs one token, which is dropped here. That is lm-evaluation-harness's loglikelihood call.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from servelm.engine.async_llm import GenerationRequest, GenerationStream
from servelm.engine.fan_out import Choice, ChoiceDelta
from servelm.obs.timeline import ApiStamp
from servelm.server.context import ServerContext
from servelm.server.errors import bad_request
from servelm.server.kv_transfer_api import kv_transfer_for
from servelm.server.logprobs import empty_completion_logprobs, extend_completion_logprobs, ids_to_decode
from servelm.server.protocol import CompletionRequest
from servelm.server.serving import (
    api_error_from_engine,
    begin_request,
    check_prompts,
    engine_error,
    finish_request,
    json_response,
    lora_name_of,
    reserve_tokens,
    respond,
    sse,
    stream_tail,
    tenant_priority,
    usage,
)  # fmt: skip


async def create_completion(ctx: ServerContext, http_request: Request, body: CompletionRequest) -> Response:
    request_id, timeline, params = begin_request(ctx, http_request, "cmpl", body)
    await ctx.structured.check(params.structured, body.structured_param)
    prompts = _prompt_list(body.prompt)
    kv_transfer = kv_transfer_for(ctx.kv_transfer, body.kv_transfer_params, len(prompts) * body.n)
    # Sizes first, before anything is tokenized (prompt_limits.py); a request that can never fit
    # is a 400 even when the server is full.
    texts = [p for p in prompts if isinstance(p, str)]
    ctx.prompt_limits.check_texts(texts, "prompt")
    check_prompts(ctx, [p for p in prompts if not isinstance(p, str)], params, "prompt", client_ids=True)
    ctx.admission.admit(len(prompts) * body.n)
    token_ids = await ctx.engine.encode_prompts(prompts)
    if texts:
        check_prompts(ctx, [ids for ids, p in zip(token_ids, prompts) if isinstance(p, str)], params, "prompt")
    timeline.stamp(ApiStamp.TOKENIZED)
    priority, slo = tenant_priority(http_request, body.priority, body.kv_retention)
    request = GenerationRequest(
        request_id, token_ids, params, timeline, priority, body.cache_salt, slo, kv_transfer=kv_transfer,
        lora_name=lora_name_of(ctx, body.model),
    )
    gen = ctx.engine.generate(request, observer=ctx.metrics)
    reserve_tokens(http_request, gen, ctx.max_model_len)
    return await respond(http_request, gen, _CompletionView(ctx, body, gen, prompts), body.stream)


def _entry(delta: ChoiceDelta, text: str, logprobs: dict[str, list[Any]] | None) -> dict[str, Any]:
    return {"index": delta.choice.index, "text": text, "logprobs": logprobs,
            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}  # fmt: skip


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


@dataclass
class _Accumulated:
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    echoed: bool = False  # the streamed echo prefix went out already
    ids_started: bool = False  # return_token_ids: the prompt's ids went out already
    text_offset: int = 0


@dataclass
class _CompletionView:
    ctx: ServerContext
    body: CompletionRequest
    gen: GenerationStream
    prompts: list[str | list[int]]
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def drop_generated(self) -> bool:
        return self.body.max_tokens == 0  # prompt scoring only

    def _header(self) -> dict[str, Any]:
        return {
            "id": self.gen.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "system_fingerprint": None,  # OpenAI's field; nothing identifies a backend configuration here
        }

    async def _echo(self, choice: Choice, acc: _Accumulated) -> tuple[str, dict[str, list[Any]] | None]:
        """The prompt's text (and its logprobs) that precede this choice's completion."""
        prompt = self.prompts[choice.prompt_index]
        prompt_ids = self.gen.prompts[choice.prompt_index]
        text = prompt if isinstance(prompt, str) else await self.ctx.tokenizer.decode(prompt_ids)
        if self.body.logprobs is None:
            return text, None
        entries = self._prompt_logprobs(choice)
        strings = await self._strings(prompt_ids, entries, in_pool=True)
        logprobs = empty_completion_logprobs()
        acc.text_offset = extend_completion_logprobs(logprobs, prompt_ids, entries, strings, acc.text_offset)
        return text, logprobs

    def _prompt_logprobs(self, choice: Choice) -> list:
        # Only each prompt's first choice scores the prompt (fan_out.child_params).
        leader = self.gen.choices[choice.prompt_index * self.body.n]
        return list(leader.state.prompt_logprobs) if leader.state is not None else []

    async def _strings(self, token_ids: list[int], entries: list, in_pool: bool) -> dict[int, str]:
        ids = ids_to_decode(token_ids, entries)
        decoded = (
            await self.ctx.tokenizer.token_strings(ids) if in_pool else self.ctx.tokenizer.decoder.token_strings(ids)
        )
        return dict(zip(ids, decoded))

    async def collect(self) -> Response:
        accumulated = {c.index: _Accumulated() for c in self.gen.choices}
        async for deltas in self.gen.deltas():
            for delta in deltas:
                acc = accumulated[delta.choice.index]
                acc.parts.append(delta.text)
                acc.token_ids.extend(delta.token_ids)
                acc.logprobs.extend(delta.logprobs or [])
        if engine_error(self.gen) is not None:
            raise api_error_from_engine(self.gen)
        choices = [await self._final_choice(c, accumulated[c.index]) for c in self.gen.choices]
        completion_tokens = sum(len(a.token_ids) for a in accumulated.values()) if not self.drop_generated else 0
        done = finish_request(self.ctx, self.gen, self._prompt_tokens(), completion_tokens, self.body.wants_timeline)
        payload = {
            **self._header(),
            "choices": choices,
            "usage": usage(self._prompt_tokens(), completion_tokens, self.gen.num_cached_prompt_tokens),
        }
        if done.timeline_dict is not None:
            payload["servelm"] = {"timeline": done.timeline_dict}
        return json_response(payload, headers=done.ttft_header)

    async def _final_choice(self, choice: Choice, acc: _Accumulated) -> dict[str, Any]:
        echo_text, logprobs = await self._echo(choice, acc) if self.body.echo else ("", None)
        text = echo_text + ("" if self.drop_generated else "".join(acc.parts))
        if self.body.logprobs is not None and not self.drop_generated:
            logprobs = logprobs or empty_completion_logprobs()
            strings = await self._strings(acc.token_ids, acc.logprobs, in_pool=True)
            extend_completion_logprobs(logprobs, acc.token_ids, acc.logprobs, strings, acc.text_offset)
        state = choice.state
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": state.finish_reason if state else None,
            "stop_reason": state.stop_reason if state else None,
            **self._token_ids(choice, acc, [] if self.drop_generated else acc.token_ids),
        }

    def _token_ids(self, choice: Choice, acc: _Accumulated, token_ids: list[int]) -> dict[str, list[int]]:
        """return_token_ids (vLLM's shape): the prompt's ids with a choice's first entry, then its new ids."""
        if not self.body.return_token_ids:
            return {}
        fields = {} if acc.ids_started else {"prompt_token_ids": self.gen.prompts[choice.prompt_index]}
        acc.ids_started = True
        return {**fields, "token_ids": token_ids}

    def _prompt_tokens(self) -> int:
        return sum(len(p) for p in self.gen.prompts)

    async def stream(self) -> AsyncIterator[bytes]:
        header = self._header()
        if self.body.include_usage:
            header["usage"] = None  # OpenAI: every chunk but the last carries "usage": null
        accumulated = {c.index: _Accumulated() for c in self.gen.choices}
        completion_tokens = 0
        try:
            plain = not (self.body.echo or self.body.logprobs is not None or self.drop_generated
                         or self.body.return_token_ids)  # fmt: skip
            async for deltas in self.gen.deltas():
                if plain:  # the common case, per token of every stream: no awaits, no accumulation
                    entries = [_entry(d, d.text, None) for d in deltas if d.text or d.finish_reason is not None]
                else:
                    rendered = [await self._stream_entry(d, accumulated[d.choice.index]) for d in deltas]
                    entries = [e for e in rendered if e is not None]
                completion_tokens += 0 if self.drop_generated else sum(len(d.token_ids) for d in deltas)
                if entries:
                    chunk = sse({**header, "choices": entries})
                    if any(d.token_ids for d in deltas):
                        self.gen.timeline.stamp(ApiStamp.FIRST_BYTE_WRITTEN)  # before the hand-off: see ApiStamp
                    yield chunk
            body = self.body
            for event in stream_tail(self.ctx, self.gen, header, body.include_usage, body.wants_timeline,
                                     self._prompt_tokens(), completion_tokens):  # fmt: skip
                yield event
        finally:
            self.gen.close()

    async def _stream_entry(self, delta: ChoiceDelta, acc: _Accumulated) -> dict[str, Any] | None:
        text, logprobs = "", None
        if self.body.echo and not acc.echoed:
            acc.echoed = True
            text, logprobs = await self._echo(delta.choice, acc)
        if not self.drop_generated:
            text += delta.text
            if self.body.logprobs is not None and delta.token_ids:
                logprobs = logprobs or empty_completion_logprobs()
                strings = await self._strings(delta.token_ids, delta.logprobs or [], in_pool=False)
                acc.text_offset = extend_completion_logprobs(
                    logprobs, delta.token_ids, delta.logprobs or [], strings, acc.text_offset
                )
        # A delta whose text is held back still carries ids when they are asked for.
        with_ids = self.body.return_token_ids and delta.token_ids
        if not text and logprobs is None and delta.finish_reason is None and not with_ids:
            return None
        entry = _entry(delta, text, logprobs)
        entry.update(self._token_ids(delta.choice, acc, [] if self.drop_generated else delta.token_ids))
        return entry
