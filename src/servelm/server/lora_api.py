"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters served from now on, as vLLM names them.

Answered only with --allow-runtime-lora-updating (404 otherwise, as a route that is not there), and
under the API key like every /v1 route. A load reads and checks the adapter in the engine core's
background thread while steps go on, and answers once it is served (200) or refused (400, saying
why: not a PEFT LoRA directory, a rank over --max-lora-rank, shapes that do not fit the base). An
unload answers at once: new requests naming the adapter get 404, those in flight run to their end.
"""

from __future__ import annotations

from collections.abc import Awaitable

from starlette.responses import PlainTextResponse, Response

from servelm.config import LoRAModule
from servelm.engine.async_client import EngineDeadError
from servelm.engine.messages import LoRAReply
from servelm.server.context import ServerContext
from servelm.server.errors import APIError, bad_request, unavailable
from servelm.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


def check_runtime_lora_allowed(ctx: ServerContext) -> None:
    """404, as a route that is not there, unless --allow-runtime-lora-updating (before the body is read)."""
    if not ctx.engine.client.config.lora.allow_runtime_lora_updating:
        raise APIError(404, "run-time LoRA loading is off: start the server with --enable-lora "
                            "--allow-runtime-lora-updating", code="not_found")  # fmt: skip


async def load_lora_adapter(ctx: ServerContext, body: LoadLoRAAdapterRequest) -> Response:
    if body.lora_name == ctx.model_name:
        raise bad_request(f"{body.lora_name!r} is the base model's name", param="lora_name")
    module = LoRAModule(body.lora_name, body.lora_path, body.base_model_name)
    _raise_for(await _call(ctx.engine.client.load_lora(module)), "lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(ctx: ServerContext, body: UnloadLoRAAdapterRequest) -> Response:
    _raise_for(await _call(ctx.engine.client.unload_lora(body.lora_name)), "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _call(call: Awaitable[LoRAReply]) -> LoRAReply:
    try:
        return await call
    except EngineDeadError as exc:
        raise unavailable(f"the engine is not serving: {exc}") from exc


def _raise_for(reply: LoRAReply, param: str) -> None:
    if reply.status == 404:
        raise APIError(404, reply.error or "no such LoRA adapter", param="lora_name", code="model_not_found")
    if reply.status != 200:
        raise bad_request(reply.error or "the LoRA adapter was refused", param=param)
