"""Everything a request handler needs, built once the engine is ready and hung on `app.state.lifecycle.ctx`."""

from __future__ import annotations

from dataclasses import dataclass

from servelm.config import LoRAModule
from servelm.engine.async_llm import AsyncLLM
from servelm.engine.supervisor import EngineSupervisor
from servelm.obs.metrics import ServerMetrics
from servelm.obs.request_log import RequestLogger
from servelm.server.admission import Admission
from servelm.server.kv_transfer_api import KVTransferInfo
from servelm.server.model_files_api import ModelFiles
from servelm.server.prompt_limits import PromptLimits
from servelm.server.structured_request import StructuredCheck
from servelm.tokenization.prompt_tokenizer import PromptTokenizer


@dataclass
class ServerContext:
    engine: AsyncLLM  # input processing, fan-out, detokenization, abort: the server only validates and renders
    metrics: ServerMetrics
    admission: Admission
    request_logger: RequestLogger
    model_name: str
    kv_transfer: KVTransferInfo  # this server's disaggregation role (kv_role None: none)
    model_files: ModelFiles  # what a new replica pulls with --model peer://this-server
    prompt_limits: PromptLimits  # prompts refused by their size, before tokenizing
    supervisor: EngineSupervisor  # restarts a dead engine core; says why the engine is down
    structured: StructuredCheck  # a structured output's spec compiles, or the request is a 400
    tool_call_parser: str | None = "hermes"  # reads tool calls from a tool_choice "auto" output (None: never)

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self.engine.tokenizer

    @property
    def lora_modules(self) -> tuple[LoRAModule, ...]:
        """The adapters a request's `model` may name: --lora-modules and those loaded at run time
        (the engine client keeps them, so that a restarted core serves them too)."""
        return self.engine.client.config.lora.lora_modules

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len
