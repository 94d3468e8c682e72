"""POST /tokenize and /detokenize: the server's own tokenizer, as vLLM exposes it.

Clients count tokens against `max_model_len`, or check what a chat template produces,
with exactly the tokenizer and template the engine sees; the work runs where the
completion endpoints run it (inline when short, the tokenizer pool when long).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from servelm.server.context import ServerContext
from servelm.server.protocol import DetokenizeRequest, TokenizeRequest
from servelm.server.serving import check_model, check_token_ids, json_response, render_chat


async def tokenize(ctx: ServerContext, body: TokenizeRequest, http_request: Request) -> Response:
    check_model(ctx, body.model, http_request)
    body.check()
    if body.messages is not None:
        tokens = await render_chat(ctx, [m.template_entry() for m in body.messages], body.add_generation_prompt)
    else:
        assert body.prompt is not None
        [tokens] = await ctx.tokenizer.encode_many([body.prompt], add_special_tokens=body.add_special_tokens)
    payload: dict = {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        payload["token_strs"] = await ctx.tokenizer.token_strings(tokens)
    return json_response(payload)


async def detokenize(ctx: ServerContext, body: DetokenizeRequest, http_request: Request) -> Response:
    check_model(ctx, body.model, http_request)
    check_token_ids(ctx, body.tokens, "tokens")
    return json_response({"prompt": await ctx.tokenizer.decode(body.tokens, body.skip_special_tokens)})
