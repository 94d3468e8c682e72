"""The runner's half of layered prefill: prompt chunks whose forward runs over several steps, by layers.

A step must end within its time target (scheduler/step_pricing.py) so that a request arriving
mid-step waits little for it. Cutting a long prompt into chunks small enough for that makes each
chunk pay the step's fixed part and, deep in the prompt, re-read the whole context for a few
tokens: on 2 CPU cores a 16-token chunk after 6,144 tokens took 214 ms, a 1,024-token one 4.4 s
(75 against 231 tokens/s). Layered prefill keeps the chunk large and cuts its forward instead:

    step s     layers [0, a) of the chunk         (+ the step's decodes and short prompts)
    step s+1   layers [a, b)
    ...
    step s+k   layers [.., L), final norm, logits ─▶ the chunk's tokens are computed

Each layer reads the K/V the chunk's earlier layers wrote into its blocks in earlier steps, and
its own context's from the pool, exactly as in one forward: the arithmetic is the same, only its
calls are spread out (greedy output does not change). Between slices the chunk's hidden states
and residual sum ([C, hidden] each) wait here; the scheduler counts the chunk's tokens as computed
only after its last layer, so nothing reads the chunk's partial K/V before then, and a request
preempted or finished mid-chunk simply drops its state (`forget`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servelm.attention.backend import AttentionBackend, CommonAttentionInputs
from servelm.attention.kv_storage import LayerKVCache
from servelm.datatypes import LayerSlice
from servelm.models.llama import LlamaForCausalLM, PartialForward
from servelm.worker.block_table import BlockTable
from servelm.worker.host_transfer import to_device
from servelm.worker.paged_inputs import paged_attention_inputs
from servelm.worker.request_state import RunnerRequestState


@dataclass
class InFlightChunk:
    """One request's chunk between two of its slices."""

    num_tokens: int
    first_position: int  # the request's num_computed_tokens when the chunk began
    common: CommonAttentionInputs  # the chunk's attention inputs, alone (a batch of one request)
    state: PartialForward  # after its layers so far


class LayeredChunks:
    """Runs layer slices and holds the chunks between them. Owned by the ModelRunner, which calls
    `run` for every slice of a step (before sampling) and `forget` for every request it forgets."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, kv_caches: Sequence[LayerKVCache],
                 block_table: BlockTable, block_size: int, device: torch.device) -> None:  # fmt: skip
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_table = block_table
        self.block_size = block_size
        self.device = device
        self.num_layers = len(model.decoder_layers)
        self._chunks: dict[str, InFlightChunk] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def forget(self, request_id: str) -> None:
        """Drop a request's chunk in flight, if any (finished, aborted, preempted). Safe to repeat."""
        self._chunks.pop(request_id, None)

    def run(self, request: RunnerRequestState, layers: LayerSlice) -> torch.Tensor | None:
        """Run `layers` of `request`'s chunk (begun by this call when start_layer is 0). Returns the
        chunk's final hidden states [num_tokens, hidden] when the slice ends the chunk (the chunk is
        then forgotten), else None. A slice that does not continue the chunk held (another size,
        another start layer) is the scheduler's bug: ValueError."""
        request_id = request.request_id
        if layers.start_layer == 0:
            chunk = self._begin(request, layers.num_tokens)
        else:
            chunk = self._chunks.get(request_id)  # type: ignore[assignment]
            if chunk is None or chunk.num_tokens != layers.num_tokens or chunk.state.next_layer != layers.start_layer:
                held = None if chunk is None else (chunk.num_tokens, chunk.state.next_layer)
                raise ValueError(f"{request_id!r}: slice {layers} does not continue the chunk held ({held})")
        if not layers.start_layer < layers.end_layer <= self.num_layers:
            raise ValueError(f"{request_id!r}: slice {layers} outside the model's {self.num_layers} layers")
        # Built again for every slice: a backend's metadata may live in buffers the next step refills.
        metadata = self.backend.build_metadata(chunk.common)
        chunk.state = self.model.run_layers(chunk.state, metadata, self.kv_caches, layers.end_layer)
        if layers.end_layer < self.num_layers:
            self._chunks[request_id] = chunk
            return None
        self._chunks.pop(request_id, None)
        return self.model.finish(chunk.state)

    def _begin(self, request: RunnerRequestState, num_tokens: int) -> InFlightChunk:
        start = request.num_computed_tokens
        if start + num_tokens > request.num_tokens:
            raise ValueError(f"{request.request_id!r}: a chunk of {num_tokens} after {start} passes its "
                             f"{request.num_tokens} tokens")  # fmt: skip
        row = torch.tensor([self.block_table.row(request.request_id)], dtype=torch.long)
        positions, common = paged_attention_inputs(
            self.block_table.table, row, torch.tensor([start]), torch.tensor([num_tokens]), self.block_size,
            self.device, self.model.embed_tokens.weight.dtype, self.kv_caches[0].dtype,
        )  # fmt: skip
        input_ids = to_device(request.token_ids(start, start + num_tokens), torch.long, self.device)
        state = self.model.begin(input_ids, positions.to(self.device, non_blocking=True))
        return InFlightChunk(num_tokens, start, common, state)
