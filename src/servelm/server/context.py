"""Everything a request handler needs, built once at start-up and hung on `app.state.ctx`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Coroutine

from servelm.engine.async_client import AsyncEngineClient
from servelm.engine.output_processor import OutputProcessor
from servelm.obs.metrics import ServerMetrics
from servelm.obs.request_log import RequestLogger
from servelm.server.admission import Admission
from servelm.tokenization.prompt_tokenizer import PromptTokenizer


@dataclass
class ServerContext:
    client: AsyncEngineClient
    tokenizer: PromptTokenizer
    processor: OutputProcessor  # one for the server: request ids are unique, its states are per request
    metrics: ServerMetrics
    admission: Admission
    request_logger: RequestLogger
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    # Fire-and-forget tasks (aborts from a cancelled stream), referenced until done so they are not GC'd.
    background: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
