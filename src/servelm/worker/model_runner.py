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
from dataclasses import dataclass

import torch

from servelm.attention.backend import AttentionBackend, AttentionMetadata, CommonAttentionInputs, slots_of
from servelm.attention.kv_storage import LayerKVCache, block_tensors
from servelm.datatypes import ModelOutput, PositionLogprobs, SchedulerOutput
from servelm.models.llama import LlamaForCausalLM
from servelm.parallel.context_backend import ContextParallelBackend, ContextParallelMetadata
from servelm.spec.proposer import DraftRequest, Proposer
from servelm.worker.block_table import BlockTable
from servelm.worker.cuda_graphs import DecodeGraphRunner
from servelm.worker.host_transfer import to_device
from servelm.worker.kv_offload import KVOffloader
from servelm.worker.multi_rank import RankFailedError, StepBroadcaster
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
class StepInputs:
    """The flattened batch of one step, in scheduler order."""

    request_ids: list[str]
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


def token_positions(num_computed: torch.Tensor, query_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of every new token and the batch index of its request, both [T] long.

    num_computed, query_lens: [R] long. Request i's tokens are positions
    num_computed[i] .. num_computed[i] + query_lens[i] - 1, laid end to end.
    """
    request_of_token = torch.repeat_interleave(torch.arange(query_lens.numel()), query_lens)  # [T]
    first_row = torch.cumsum(query_lens, 0) - query_lens  # [R] row of each request's first token
    offset_in_request = torch.arange(request_of_token.numel()) - first_row[request_of_token]
    return num_computed[request_of_token] + offset_in_request, request_of_token


def paged_attention_inputs(
    table: torch.Tensor,  # [num_rows, max_blocks] int32, CPU: a BlockTable's tensor
    rows: torch.Tensor,  # [R] long: each request's row in `table`
    num_computed: torch.Tensor,  # [R] long: positions already in the KV pool
    query_lens: torch.Tensor,  # [R] long: new tokens this forward
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,  # what the KV pool stores (the model's dtype, or int8 / fp8 codes)
) -> tuple[torch.Tensor, CommonAttentionInputs]:
    """Positions ([T] long, CPU) and attention inputs of a forward over paged K/V whose request i
    runs query_lens[i] new tokens after num_computed[i] (the runner's steps, a draft model's)."""
    seq_lens = num_computed + query_lens  # [R]
    positions, request_of_token = token_positions(num_computed, query_lens)  # [T] each
    slot_mapping = slots_of(table, rows[request_of_token], positions, block_size)  # [T] long
    max_blocks = (int(seq_lens.max()) + block_size - 1) // block_size  # the columns any request reaches
    common = CommonAttentionInputs.from_lens(
        query_lens,
        seq_lens,
        slot_mapping=slot_mapping.to(device, non_blocking=True),
        block_table=table[rows, :max_blocks],  # [R, max_blocks] int32, CPU
        block_size=block_size,
        device=device,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    return positions, common


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

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Run one step; the output carries how long that took (the runner is the one that knows)."""
        started = time.perf_counter()
        if self.followers is not None:
            return self._execute_with_followers(scheduler_output, started)
        offloader = self.kv_offloader
        if offloader is not None:  # saves copy blocks out before this step's forward may overwrite them
            offloader.apply(scheduler_output.kv_transfers)
        output = self._execute(scheduler_output)
        if offloader is not None:
            # Nothing to compute (requests wait for their KV): wait a little for a load instead of spinning.
            wait_s = EMPTY_STEP_LOAD_WAIT_S if scheduler_output.total_num_scheduled_tokens == 0 else 0.0
            output.kv_load_results = offloader.take_results(wait_s)
            output.kv_saved_bytes = offloader.take_saved_bytes()
            output.kv_exports_served = offloader.take_served()
        output.execute_seconds = time.perf_counter() - started
        return output

    def _execute_with_followers(self, scheduler_output: SchedulerOutput, started: float) -> ModelOutput:
        """Rank 0 of a multi-rank worker: the step goes to every rank, then runs here. Any failure
        leaves the ranks out of step for good (multi_rank.py): it is fatal, not a request's."""
        followers = self.followers
        assert followers is not None
        followers.send(scheduler_output)
        try:
            output = self._execute(scheduler_output)
        except Exception as exc:
            followers.failed(f"a step failed on rank 0: {exc!r}")
            raise RankFailedError(f"a step failed on rank 0 of a multi-rank worker: {exc!r}") from exc
        output.execute_seconds = time.perf_counter() - started
        return output

    def close(self) -> None:
        """Stop the other ranks of a multi-rank worker (nothing to do alone)."""
        if self.followers is not None:
            self.followers.close()

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        self._update_mirrors(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelOutput(sampled_token_ids={})
        inputs = self._prepare_inputs(scheduler_output, self._is_graph_step(scheduler_output))
        hidden = self._forward(inputs)
        output = ModelOutput(sampled_token_ids={rid: [] for rid in inputs.request_ids})
        output.prompt_logprobs = self._prompt_logprobs(inputs, hidden)
        if inputs.samples:
            self._sample(inputs, hidden, output)
            if self.proposer is not None:
                self._propose(inputs.samples, output, scheduler_output.num_drafts_wanted)
        return output

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of every row of the step, [T, hidden]. Under context parallelism this
        rank computes only its rows (every cp-th position of each request) and the rows are
        gathered back, so sampling and prompt logprobs see the whole batch on every rank."""
        backend, metadata = self.attention_backend, inputs.metadata
        if metadata is None:
            assert self.decode_graphs is not None  # _is_graph_step
            return self.decode_graphs.forward(inputs.input_ids, inputs.positions, inputs.common)
        if not isinstance(backend, ContextParallelBackend) or not isinstance(metadata, ContextParallelMetadata):
            return self.model(inputs.input_ids, inputs.positions, metadata, self.kv_caches)
        local = metadata.local_token_index
        hidden = self.model(inputs.input_ids[local], inputs.positions[local], metadata, self.kv_caches)
        return backend.gather_hidden(hidden, metadata)

    def _is_graph_step(self, so: SchedulerOutput) -> bool:
        """Whether the decode graph runner runs this step: every request a plain decode (one token, no
        drafts, no prompt logprobs), the batch within its largest bucket, and no KV load in flight
        (started before or by this step: a capture must not overlap the loader thread's copies)."""
        graphs = self.decode_graphs
        if graphs is None or not graphs.fits(len(so.num_scheduled_tokens)) or so.scheduled_draft_token_ids:
            return False
        if self.kv_offloader is not None and self.kv_offloader.has_loads_in_flight:
            return False
        return all(
            num_tokens == 1 and self.requests[rid].sampling_params.prompt_logprobs is None
            for rid, num_tokens in so.num_scheduled_tokens.items()
        )

    # -- mirrors -----------------------------------------------------------------------

    def _update_mirrors(self, so: SchedulerOutput) -> None:
        """The one place SchedulerOutput is applied: request states and their block table rows."""
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            state = self.requests.pop(request_id, None)
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

    def _prepare_inputs(self, so: SchedulerOutput, graph_step: bool = False) -> StepInputs:
        request_ids = list(so.num_scheduled_tokens)
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
            input_ids=to_device(token_ids, torch.long, self.device),
            positions=positions.to(self.device, non_blocking=True),
            common=common,
            metadata=None if graph_step else self.attention_backend.build_metadata(common),
            samples=samples,
            sample_rows=sample_rows,
        )

    # -- sampling ----------------------------------------------------------------------

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, output: ModelOutput) -> None:
        """One sampler row per verified position (see spec_verify.py); without drafts, one per request.
        The host waits for the device once, for the sampled ids and logprobs together (to_host)."""
        rows = to_device(inputs.sample_rows, torch.long, self.device)
        logits = self.model.compute_logits(hidden[rows])  # [S, V] float32
        row_states = [v.state for v in inputs.samples for _ in range(v.num_rows)]
        histories = [history for v in inputs.samples for history in v.output_histories()]
        metadata = SamplingMetadata.build(
            params=[s.sampling_params for s in row_states],
            prompt_token_ids=[s.prompt_token_ids for s in row_states],
            output_token_ids=histories,
            generators=[s.generator for s in row_states],
            vocab_size=self.vocab_size,
            device=self.device,
            banned_token_ids=[self._banned_ids(s, len(h)) for s, h in zip(row_states, histories)],
        )
        host = self.sampler(logits, metadata).to_host(metadata.num_logprobs)
        sampled, position_logprobs = host.token_ids, host.logprobs
        first_row = 0
        for verification in inputs.samples:
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
        if num_output_tokens >= params.min_tokens:
            return []
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
