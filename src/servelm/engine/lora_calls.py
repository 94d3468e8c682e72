"""Run-time LoRA loads and unloads sent by the API to the engine core, each answered once it is done.

    LoadLoRA    the adapter is read and checked in the background (lora/registry.py), steps going on;
                answered when it is served (200) or refused (400, saying why)
    UnloadLoRA  answered at once: 200 (new requests naming it get 404; those in flight run to
                their end, its weights dropped after them) or 404 (no such adapter)
"""

from __future__ import annotations

import logging

from servelm.engine.core import EngineCore
from servelm.engine.messages import LoadLoRA, LoRAReply, UnloadLoRA
from servelm.lora.adapter import LoRAAdapterError
from servelm.lora.registry import LoadCall

logger = logging.getLogger(__name__)


class LoRACalls:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._loading: list[tuple[int, LoadCall]] = []  # (call id, its read)

    @property
    def pending(self) -> bool:
        return bool(self._loading)

    def handle(self, message: LoadLoRA | UnloadLoRA) -> LoRAReply | None:
        """The reply, when it is known now; a load's comes from finished() later."""
        if isinstance(message, UnloadLoRA):
            try:
                self.core.unload_lora(message.name)
            except KeyError:
                return LoRAReply(message.call_id, 404, f"no LoRA adapter named {message.name!r} is loaded")
            return LoRAReply(message.call_id)
        try:
            self._loading.append((message.call_id, self.core.start_lora_load(message.module)))
        except LoRAAdapterError as exc:
            return LoRAReply(message.call_id, 400, str(exc))
        return None

    def finished(self) -> list[LoRAReply]:
        """Replies for the loads whose read is done, each now served or refused."""
        replies = []
        for entry in [e for e in self._loading if e[1].read.done()]:
            self._loading.remove(entry)
            call_id, call = entry
            try:
                self.core.finish_lora_load(call)
            except LoRAAdapterError as exc:
                replies.append(LoRAReply(call_id, 400, str(exc)))
            except Exception as exc:  # a file safetensors cannot parse, a directory gone since
                logger.warning("LoRA adapter %r could not be loaded", call.module.name, exc_info=exc)
                replies.append(LoRAReply(call_id, 400, f"LoRA adapter {call.module.name!r} could not be read: {exc}"))
            else:
                replies.append(LoRAReply(call_id))
        return replies
