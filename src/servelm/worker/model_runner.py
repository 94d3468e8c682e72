"""ModelRunner: executes one SchedulerOutput as a single forward over flattened tokens.

    SchedulerOutput ──▶ update mirrors (request states + block table rows)
                    ──▶ build inputs (ids, positions, slots: vectorised over the persistent table)
                    ──▶ backend.build_metadata (once) ──▶ model.forward
                        (a pure-decode step: the decode graph runner's buffers and graph instead)
                    ──▶ logits of rows that sample (+ prompt-logprob rows) ──▶ Sampler ──▶ ModelOutput

The runner owns tensors (model, KV pool, block table) and decides nothing: which tokens
to run came from the scheduler; whether a request samples follows from the arithmetic
(its computed tokens catch up with all its tokens this step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from servelm.attention.backend import AttentionBackend, AttentionMetadata, CommonAttentionInputs
from servelm.attention.kv_storage import LayerKVCache, block_tensors
from servelm.datatypes import ModelOutput, PositionLogprobs, SchedulerOutput
from servelm.lora.layers import NO_ADAPTER, LoRABatch
from servelm.lora.slots import LoRASlots
from servelm.models.llama import LlamaForCausalLM
from servelm.parallel.context_backend import ContextParallelBackend, ContextParallelMetadata
from servelm.spec.proposer import DraftRequest, Proposer
from servelm.structured.masks import GrammarMasks
from servelm.worker.block_table import BlockTable
from servelm.worker.cuda_graphs import DecodeGraphRunner
from servelm.worker.host_transfer import to_device
from servelm.worker.kv_offload import KVOffloader
from servelm.worker.layered_chunks import LayeredChunks
from servelm.worker.multi_rank import RankFailedError, StepBroadcaster
from servelm.worker.paged_inputs import paged_attention_inputs
from servelm.worker.prompt_logprobs import chunk_prompt_logprobs
from servelm.worker.request_state import RunnerRequestState
from servelm.worker.sampler import Sampler
from servelm.worker.sampling_metadata import SamplingMetadata
from servelm.worker.spec_verify import VerificationRows, accept_drafts


def attention_backend_of(model: LlamaForCausalLM) -> AttentionBackend:
    """The backend the model's attention layers call (one instance, shared by every layer)."""
    return model.decoder_layers[0].self_attn.backend


# A step with nothing to compute waits this long for a KV load to end (the engine would spin otherwise).
EMPTY_STEP_LOAD_WAIT_S = 0.005


@dataclass
class SampleRows:
    """The requests that sample this step and their rows in the step's hidden states, request after
    request: the last 1 + k rows of each (k drafts verified)."""

    samples: list[VerificationRows] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def extend(self, samples: list[VerificationRows], rows: list[int]) -> None:
        self.samples.extend(samples)
        self.rows.extend(rows)


@dataclass
class StepInputs:
    """The flattened batch of one step, in scheduler order."""

    request_ids: list[str]
    num_rows: list[int]  # each request's rows of the batch (its scheduled tokens, drafts included)
    input_ids: torch.Tensor  # [T] long, on device
    positions: torch.Tensor  # [T] long, on device
    common: CommonAttentionInputs  # what the backend built `metadata` from
    # The backend's own, built once for every layer; None on a step the decode graph runner runs
    # (it builds its own from its buffers).
    metadata: AttentionMetadata | None
    # Requests whose last scheduled token is their last token (and drafts after it, if any),
    # with their sampler rows: the last 1 + k rows of their tokens, k = drafts verified.
    samples: list[VerificationRows]
    sample_rows: list[int]  # flattened batch rows of every sampler row, request after request


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerKVCache],  # per layer [2, num_blocks, block_size, KVH, D] (attention/kv_storage.py)
        block_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        max_num_seqs: int,  # most requests the scheduler runs at once: rows of the block table
        max_model_len: int,  # longest request: bounds the block table's width
        proposer: Proposer | None = None,  # speculative decoding: guesses drafts after each step's sampling
        max_draft_tokens: int = 0,  # most drafts proposed per request (SpeculativeConfig.num_speculative_tokens)
        # The table this runner mirrors block ids into; given when a draft-model proposer reads the same
        # rows (its own KV in the same blocks). None: a table of its own.
        block_table: BlockTable | None = None,
        kv_offloader: KVOffloader | None = None,  # KV tiers: moves blocks to/from host memory and disk
        # Multi-rank workers (rank 0 only): every step goes to the other ranks before it runs here.
        followers: StepBroadcaster | None = None,
        # Pure-decode steps through persistent buffers and CUDA graphs (cuda_graphs.py); single rank only.
        decode_graphs: DecodeGraphRunner | None = None,
        # LoRA adapters (servelm.lora): the model's slots, filled as each step's requests need them.
        lora: LoRASlots | None = None,
    ) -> None:
        if decode_graphs is not None and followers is not None:
            raise ValueError("decode graphs run on a single rank: the other ranks would see unpadded batches")
        self.model = model
        self.attention_backend = attention_backend_of(model)
        self.kv_caches = kv_caches
        self.kv_dtype = kv_caches[0].dtype  # what the pool stores: the model's dtype, int8 or float8_e4m3fn
        # Every pool tensor whose dim 1 is the block id, in a fixed order (per layer: K/V, or codes then
        # scales): a block's bytes are their [:, block_id] slices (what a KV mover copies).
        self.kv_block_tensors: list[torch.Tensor] = block_tensors(kv_caches)
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.dtype = model.embed_tokens.weight.dtype
        self.vocab_size = model.arch.vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}
        if block_table is None:
            block_table = BlockTable.for_requests(max_num_seqs, max_model_len, block_size)
        self.block_table = block_table
        self.proposer = proposer
        self.max_draft_tokens = max_draft_tokens
        self.kv_offloader = kv_offloader
        self.followers = followers
        self.decode_graphs = decode_graphs
        if lora is not None and (decode_graphs is not None or followers is not None):
            raise ValueError("LoRA runs on a single rank, without decode graphs")
        self.lora = lora
        self._adapter_slots: dict[str, int] = {}  # this step's requests' slots (LoRA)
        # Layered prefill's chunks in flight (layered_chunks.py); None under context parallelism,
        # whose ranks each compute a share of a chunk's rows (its scheduler sends no layer slices).
        self.layered_chunks: LayeredChunks | None = None
        if not isinstance(self.attention_backend, ContextParallelBackend):
            self.layered_chunks = LayeredChunks(model, self.attention_backend, kv_caches, self.block_table, block_size,
                                                device)  # fmt: skip

    def execute(self, scheduler_output: SchedulerOutput, grammar_masks: GrammarMasks | None = None) -> ModelOutput:
        """Run one step; the output carries how long that took (the runner is the one that knows).
        `grammar_masks`: the constrained requests' token bitmasks, being filled while this runs."""
        started = time.perf_counter()
        if self.followers is not None:
            return self._execute_with_followers(scheduler_output, started, grammar_masks)
        offloader = self.kv_offloader
        if offloader is not None:  # saves copy blocks out before this step's forward may overwrite them
            offloader.apply(scheduler_output.kv_transfers)
        output = self._execute(scheduler_output, grammar_masks)
        if offloader is not None:
            # Nothing to compute (requests wait for their KV): wait a little for a load instead of spinning.
            wait_s = 0.0 if scheduler_output.has_work else EMPTY_STEP_LOAD_WAIT_S
            output.kv_load_results = offloader.take_results(wait_s)
            output.kv_saved_bytes = offloader.take_saved_bytes()
            output.kv_exports_served = offloader.take_served()
        output.execute_seconds = time.perf_counter() - started
        return output

    def _execute_with_followers(self, scheduler_output: SchedulerOutput, started: float,
                                grammar_masks: GrammarMasks | None) -> ModelOutput:  # fmt: skip
        """Rank 0 of a multi-rank worker: the step goes to every rank, then runs here. Any failure
        leaves the ranks out of step for good (multi_rank.py): it is fatal, not a request's."""
        followers = self.followers
        assert followers is not None
        followers.send(scheduler_output)
        try:
            output = self._execute(scheduler_output, grammar_masks)
        except Exception as exc:
            followers.failed(f"a step failed on rank 0: {exc!r}")
            raise RankFailedError(f"a step failed on rank 0 of a multi-rank worker: {exc!r}") from exc
        output.execute_seconds = time.perf_counter() - started
        return output

    def close(self) -> None:
        """Stop the other ranks of a multi-rank worker (nothing to do alone)."""
        if self.followers is not None:
            self.followers.close()

    def _execute(self, scheduler_output: SchedulerOutput, grammar_masks: GrammarMasks | None = None) -> ModelOutput:
        self._update_mirrors(scheduler_output)
        if not scheduler_output.has_work:
            return ModelOutput(sampled_token_ids={})
        so = scheduler_output
        output = ModelOutput(sampled_token_ids={rid: [] for rid in so.num_scheduled_tokens})
        if self.lora is not None:
            ids = list(so.num_scheduled_tokens)
            self._adapter_slots = dict(zip(ids, self.lora.slots_for([self.requests[rid].lora_name for rid in ids])))
        try:
            return self._execute_rows(so, output, grammar_masks)
        finally:
            self._lora_rows([], [])  # no forward outside a step sees this step's adapters

    def _execute_rows(self, so: SchedulerOutput, output: ModelOutput, grammar_masks: GrammarMasks | None) -> ModelOutput:
        # Layer slices first (layered_chunks.py): those that end their chunk give its hidden states,
        # which sample and give prompt logprobs like the step's own rows.
        completed = self._run_layer_slices(so)
        step_ids = [rid for rid in so.num_scheduled_tokens if rid not in so.layer_slices]
        if self.layered_chunks is not None and len(self.layered_chunks):
            for rid in step_ids:  # a token chunk in place of a chunk in flight: the scheduler started over
                self.layered_chunks.forget(rid)
        rows = SampleRows()
        hidden_parts: list[torch.Tensor] = []
        if step_ids:
            inputs = self._prepare_inputs(so, step_ids, self._is_graph_step(so, step_ids))
            hidden = self._forward(inputs)
            output.prompt_logprobs = self._prompt_logprobs(inputs, hidden)
            rows.extend(inputs.samples, inputs.sample_rows)
            hidden_parts.append(hidden)
        offset = hidden_parts[0].shape[0] if hidden_parts else 0
        for request_id, chunk_hidden in completed.items():
            state = self.requests[request_id]
            num_rows = chunk_hidden.shape[0]
            if state.num_computed_tokens + num_rows == state.num_tokens:  # the prompt's last chunk: it samples
                rows.extend([VerificationRows.of(state, [])], [offset + num_rows - 1])
            num_top = state.sampling_params.prompt_logprobs
            if num_top is not None:
                output.prompt_logprobs[request_id] = chunk_prompt_logprobs(
                    self.model, chunk_hidden, state.prompt_token_ids, state.num_computed_tokens, num_top
                )
            hidden_parts.append(chunk_hidden)
            offset += num_rows
        if rows.samples:
            all_hidden = hidden_parts[0] if len(hidden_parts) == 1 else torch.cat(hidden_parts)
            self._sample(rows, all_hidden, output, grammar_masks)
            if self.proposer is not None:
                self._propose(rows.samples, output, so.num_drafts_wanted)
        elif self.device.type == "cuda":
            # Nothing sampled, so nothing waited for the device: wait here, or the step's time (which
            # the scheduler's cost model learns from) would be its launches, and the next step's its work.
            torch.cuda.current_stream(self.device).synchronize()
        return output

    def _run_layer_slices(self, so: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Every layer slice of the step, in order; the final hidden states of the chunks that completed."""
        if not so.layer_slices:
            return {}
        if self.layered_chunks is None:
            raise ValueError("layer slices sent to a runner without layered prefill (context parallelism)")
        completed = {}
        for request_id, layers in so.layer_slices.items():
            self._lora_rows([request_id], [layers.num_tokens])
            chunk_hidden = self.layered_chunks.run(self.requests[request_id], layers)
            if chunk_hidden is not None:
                completed[request_id] = chunk_hidden
        return completed

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of every row of the step, [T, hidden]. Under context parallelism this
        rank computes only its rows (every cp-th position of each request) and the rows are
        gathered back, so sampling and prompt logprobs see the whole batch on every rank."""
        backend, metadata = self.attention_backend, inputs.metadata
        self._lora_rows(inputs.request_ids, inputs.num_rows)
        if metadata is None:
            assert self.decode_graphs is not None  # _is_graph_step
            return self.decode_graphs.forward(inputs.input_ids, inputs.positions, inputs.common)
        if not isinstance(backend, ContextParallelBackend) or not isinstance(metadata, ContextParallelMetadata):
            return self.model(inputs.input_ids, inputs.positions, metadata, self.kv_caches)
        local = metadata.local_token_index
        hidden = self.model(inputs.input_ids[local], inputs.positions[local], metadata, self.kv_caches)
        return backend.gather_hidden(hidden, metadata)

    def _lora_rows(self, request_ids: list[str], num_rows: list[int]) -> None:
        """The next forward's rows, request by request (LoRA: which run which adapter slot)."""
        if self.lora is not None:
            batch = LoRABatch.of([self._adapter_slots.get(rid, NO_ADAPTER) for rid in request_ids], num_rows)
            self.lora.model.set_batch(batch if batch.segments else None)

    def _is_graph_step(self, so: SchedulerOutput, request_ids: list[str]) -> bool:
        """Whether the decode graph runner runs this step: every request a plain decode (one token, no
        drafts, no prompt logprobs), the batch within its largest bucket, and no KV load in flight
        (started before or by this step: a capture must not overlap the loader thread's copies)."""
        graphs = self.decode_graphs
        if graphs is None or not graphs.fits(len(request_ids)) or so.scheduled_draft_token_ids:
            return False
        if self.kv_offloader is not None and self.kv_offloader.has_loads_in_flight:
            return False
        return all(
            so.num_scheduled_tokens[rid] == 1 and self.requests[rid].sampling_params.prompt_logprobs is None
            for rid in request_ids
        )

    # -- mirrors -----------------------------------------------------------------------

    def _update_mirrors(self, so: SchedulerOutput) -> None:
        """The one place SchedulerOutput is applied: request states and their block table rows."""
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            state = self.requests.pop(request_id, None)
            if self.layered_chunks is not None:
                self.layered_chunks.forget(request_id)
            if state is not None:
                self.block_table.remove(request_id)
                if self.proposer is not None:
                    finished = request_id in so.finished_request_ids
                    self.proposer.release(request_id, state.all_token_ids() if finished else None)
        for new in so.new_requests:
            self.requests[new.request_id] = RunnerRequestState.from_new(new, self.vocab_size)
            self.block_table.add(new.request_id, new.block_ids)
        for diff in so.cached_requests:
            self.requests[diff.request_id].apply(diff)
            self.block_table.append(diff.request_id, diff.new_block_ids)

    # -- inputs ------------------------------------------------------------------------

    def _prepare_inputs(self, so: SchedulerOutput, request_ids: list[str], graph_step: bool = False) -> StepInputs:
        """The flattened batch of `request_ids` (the step's requests but its completing layer slices)."""
        states = [self.requests[rid] for rid in request_ids]
        num_computed = torch.tensor([s.num_computed_tokens for s in states], dtype=torch.long)  # [R]
        query_lens = torch.tensor([so.num_scheduled_tokens[rid] for rid in request_ids], dtype=torch.long)  # [R]
        seq_lens = num_computed + query_lens  # [R]
        ends_in_request = seq_lens.tolist()
        drafts = [so.scheduled_draft_token_ids.get(rid, []) for rid in request_ids]
        token_ids: list[int] = []
        for state, start, end, request_drafts in zip(states, num_computed.tolist(), ends_in_request, drafts):
            # Drafts follow the request's last token: they are not its tokens until accepted.
            token_ids.extend(state.token_ids(start, end - len(request_drafts)))
            token_ids.extend(request_drafts)
        rows = torch.tensor([self.block_table.row(rid) for rid in request_ids], dtype=torch.long)  # [R]
        positions, common = paged_attention_inputs(
            self.block_table.table, rows, num_computed, query_lens, self.block_size, self.device, self.dtype,
            self.kv_dtype,
        )  # fmt: skip
        ends_in_batch = common.query_start_loc[1:].tolist()
        # Caught up (this step's last logits give a new token): sample from the request's last row,
        # or from its last 1 + k rows when it verifies k drafts.
        samples: list[VerificationRows] = []
        sample_rows: list[int] = []
        for i, state in enumerate(states):
            if ends_in_request[i] == state.num_tokens + len(drafts[i]):
                verification = VerificationRows.of(state, drafts[i])
                samples.append(verification)
                sample_rows.extend(range(ends_in_batch[i] - verification.num_rows, ends_in_batch[i]))
        return StepInputs(
            request_ids=request_ids,
            num_rows=query_lens.tolist(),
            input_ids=to_device(token_ids, torch.long, self.device),
            positions=positions.to(self.device, non_blocking=True),
            common=common,
            metadata=None if graph_step else self.attention_backend.build_metadata(common),
            samples=samples,
            sample_rows=sample_rows,
        )

    # -- sampling ----------------------------------------------------------------------

    def _sample(self, sample_rows: SampleRows, hidden: torch.Tensor, output: ModelOutput,
                grammar_masks: GrammarMasks | None = None) -> None:  # fmt: skip
        """One sampler row per verified position (see spec_verify.py); without drafts, one per request.
        The host waits for the device once, for the sampled ids and logprobs together (to_host)."""
        rows = to_device(sample_rows.rows, torch.long, self.device)
        logits = self.model.compute_logits(hidden[rows])  # [S, V] float32
        row_states = [v.state for v in sample_rows.samples for _ in range(v.num_rows)]
        histories = [history for v in sample_rows.samples for history in v.output_histories()]
        metadata = SamplingMetadata.build(
            params=[s.sampling_params for s in row_states],
            prompt_token_ids=[s.prompt_token_ids for s in row_states],
            output_token_ids=histories,
            generators=[s.generator for s in row_states],
            vocab_size=self.vocab_size,
            device=self.device,
            banned_token_ids=[self._banned_ids(s, len(h)) for s, h in zip(row_states, histories)],
            # The mask fill ran beside the forward; this is the first wait for it.
            allowed_bitmask=grammar_masks.for_rows([s.request_id for s in row_states]) if grammar_masks else None,
        )
        host = self.sampler(logits, metadata).to_host(metadata.num_logprobs)
        sampled, position_logprobs = host.token_ids, host.logprobs
        first_row = 0
        for verification in sample_rows.samples:
            request_id = verification.state.request_id
            end_row = first_row + verification.num_rows
            emitted = accept_drafts(verification.drafts, sampled[first_row:end_row])
            verification.rewind(len(emitted), self.vocab_size)
            output.sampled_token_ids[request_id] = emitted
            entries = position_logprobs[first_row : first_row + len(emitted)] if position_logprobs else []
            if entries and all(e is not None for e in entries):
                output.logprobs[request_id] = [e for e in entries if e is not None]
            first_row = end_row

    def _propose(self, samples: list[VerificationRows], output: ModelOutput, wanted: dict[str, int]) -> None:
        """Drafts for the next step (`output.draft_token_ids`), for the requests that sampled and may
        speculate, as many as the scheduler's controller can use and the request's max_tokens
        leaves room for. `output.propose_seconds` times the proposer only when it had work: a
        step that asked for nothing must not dilute the cost per draft the controller charges."""
        assert self.proposer is not None
        self._lora_rows([], [])  # drafts are proposed without the adapters (verified with them)
        requests = []
        for verification in samples:
            state = verification.state
            params = state.sampling_params
            emitted = output.sampled_token_ids[state.request_id]
            limit = min(self.max_draft_tokens, wanted.get(state.request_id, self.max_draft_tokens))
            if params.num_speculative_tokens is not None:
                limit = min(limit, params.num_speculative_tokens)
            if params.max_tokens is not None:  # all accepted would emit limit + 1 tokens
                limit = min(limit, params.max_tokens - len(state.output_token_ids) - len(emitted) - 1)
            if limit > 0:
                token_ids = state.all_token_ids() + emitted
                requests.append(DraftRequest(state.request_id, token_ids, len(state.prompt_token_ids), limit))
        if requests:
            proposing = time.perf_counter()
            output.draft_token_ids = self.proposer.propose(requests)
            output.propose_seconds = time.perf_counter() - proposing

    def _banned_ids(self, state: RunnerRequestState, num_output_tokens: int) -> list[int]:
        """Under min_tokens a request may not stop: its EOS and stop ids are masked out. A draft
        position counts the drafts before it as output (`num_output_tokens`)."""
        params = state.sampling_params
        if num_output_tokens >= params.min_tokens or params.structured is not None:
            return []  # (a grammar decides where a constrained output may end)
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned.extend(self.eos_token_ids)
        return [t for t in banned if 0 <= t < self.vocab_size]

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, list[PositionLogprobs | None]]:
        result: dict[str, list[PositionLogprobs | None]] = {}
        starts = inputs.common.query_start_loc.tolist()
        seq_lens = inputs.common.seq_lens.tolist()
        for i, request_id in enumerate(inputs.request_ids):
            state = self.requests[request_id]
            num_top = state.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            chunk_start = seq_lens[i] - (starts[i + 1] - starts[i])
            result[request_id] = chunk_prompt_logprobs(
                self.model, hidden[starts[i] : starts[i + 1]], state.prompt_token_ids, chunk_start, num_top
            )
        return result
