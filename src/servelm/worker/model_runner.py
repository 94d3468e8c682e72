"""ModelRunner: executes one SchedulerOutput as a single forward over flattened tokens.

    SchedulerOutput ──▶ update mirrors ──▶ build inputs (ids, positions, slots, metadata)
                    ──▶ model.forward ──▶ logits of rows that sample (+ prompt-logprob rows)
                    ──▶ Sampler ──▶ ModelOutput

The runner owns tensors (model, KV pool) and decides nothing: which tokens to run
came from the scheduler; whether a request samples follows from the arithmetic (its
computed tokens catch up with all its tokens this step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from servelm.attention.backend import AttentionMetadata
from servelm.datatypes import ModelOutput, PositionLogprobs, SchedulerOutput
from servelm.models.llama import LlamaForCausalLM
from servelm.worker.prompt_logprobs import chunk_prompt_logprobs
from servelm.worker.request_state import RunnerRequestState
from servelm.worker.sampler import Sampler
from servelm.worker.sampling_metadata import SamplingMetadata


@dataclass
class StepInputs:
    """The flattened batch of one step, in scheduler order."""

    request_ids: list[str]
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    metadata: AttentionMetadata
    sample_request_ids: list[str]  # requests whose last scheduled token is their last token
    sample_rows: list[int]  # flattened row of each one's last token


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, KVH, D]
        block_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.vocab_size = model.arch.vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Run one step; the output carries how long that took (the runner is the one that knows)."""
        started = time.perf_counter()
        output = self._execute(scheduler_output)
        output.execute_seconds = time.perf_counter() - started
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        self._update_mirrors(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelOutput(sampled_token_ids={})
        inputs = self._prepare_inputs(scheduler_output)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata, self.kv_caches)
        output = ModelOutput(sampled_token_ids={rid: [] for rid in inputs.request_ids})
        output.prompt_logprobs = self._prompt_logprobs(inputs, hidden)
        if inputs.sample_request_ids:
            self._sample(inputs, hidden, output)
        return output

    # -- mirrors -----------------------------------------------------------------------

    def _update_mirrors(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            self.requests.pop(request_id, None)
        for new in so.new_requests:
            self.requests[new.request_id] = RunnerRequestState.from_new(new, self.device, self.vocab_size)
        for diff in so.cached_requests:
            self.requests[diff.request_id].apply(diff)

    # -- inputs ------------------------------------------------------------------------

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        request_ids = list(so.num_scheduled_tokens)
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_request_ids: list[str] = []
        sample_rows: list[int] = []
        for request_id in request_ids:
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + so.num_scheduled_tokens[request_id]
            token_ids.extend(state.token_ids(start, end))
            positions.extend(range(start, end))
            slots.extend(self._slots(state.block_ids, start, end))
            query_start_loc.append(len(token_ids))
            seq_lens.append(end)
            block_tables.append(state.block_ids)
            if end == state.num_tokens:  # caught up: this step's last logits give a new token
                sample_request_ids.append(request_id)
                sample_rows.append(len(token_ids) - 1)
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=block_tables,
            block_size=self.block_size,
        )
        return StepInputs(
            request_ids=request_ids,
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            metadata=metadata,
            sample_request_ids=sample_request_ids,
            sample_rows=sample_rows,
        )

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        # slot = block_ids[pos // block_size] * block_size + pos % block_size
        bs = self.block_size
        return [block_ids[pos // bs] * bs + pos % bs for pos in range(start, end)]

    # -- sampling ----------------------------------------------------------------------

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, output: ModelOutput) -> None:
        rows = torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [S, V] float32
        states = [self.requests[rid] for rid in inputs.sample_request_ids]
        metadata = SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            generators=[s.generator for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
            banned_token_ids=[self._banned_ids(s) for s in states],
        )
        result = self.sampler(logits, metadata)
        sampled = result.sampled_token_ids.tolist()
        position_logprobs: list[PositionLogprobs | None] = (
            result.logprobs.to_position_logprobs(metadata.num_logprobs) if result.logprobs is not None else []
        )
        for i, request_id in enumerate(inputs.sample_request_ids):
            output.sampled_token_ids[request_id] = [sampled[i]]
            if position_logprobs and position_logprobs[i] is not None:
                output.logprobs[request_id] = [position_logprobs[i]]

    def _banned_ids(self, state: RunnerRequestState) -> list[int]:
        """Under min_tokens a request may not stop: its EOS and stop ids are masked out."""
        params = state.sampling_params
        if len(state.output_token_ids) >= params.min_tokens:
            return []
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned.extend(self.eos_token_ids)
        return [t for t in banned if 0 <= t < self.vocab_size]

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, list[PositionLogprobs | None]]:
        result: dict[str, list[PositionLogprobs | None]] = {}
        starts = inputs.metadata.query_start_loc
        for i, request_id in enumerate(inputs.request_ids):
            state = self.requests[request_id]
            num_top = state.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            chunk_start = inputs.metadata.seq_lens[i] - (starts[i + 1] - starts[i])
            result[request_id] = chunk_prompt_logprobs(
                self.model, hidden[starts[i] : starts[i + 1]], state.prompt_token_ids, chunk_start, num_top
            )
        return result
