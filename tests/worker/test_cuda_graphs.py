"""The decode graph runner's bookkeeping on CPU: buckets, padding rows, persistent buffers, metadata
rebuilt after each refill, and which steps take the graph path; then the whole engine with the
path forced on against the engine without it (same greedy tokens, same KV in the real blocks, the
padding block never handed out).

On CPU nothing is captured: the runner fills its buffers exactly as it would before a replay and
runs the padded batch eagerly (DecodeGraphMode.EAGER_BUFFERS). The model, the torch backend, the
runner and the scheduler are the real ones; the backend is subclassed only to record its calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from dataclasses import dataclass, field

import pytest
import torch

from servelm.attention.backend import CommonAttentionInputs, DecodeGraphBuffers, register_backend
from servelm.attention.kv_storage import block_tensors
from servelm.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from servelm.cli import add_engine_arguments, engine_config_from_args
from servelm.config import CudaGraphConfig, EngineConfig
from servelm.datatypes import (
    CachedRequestData,
    EngineRequest,
    KVLoad,
    KVMedium,
    KVSave,
    KVTransfers,
    NewRequestData,
    SchedulerOutput,
)
from servelm.engine.builder import build_engine
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.sampling_params import SamplingParams
from servelm.worker.cuda_graphs import (
    DecodeGraphMode,
    DecodeGraphRunner,
    capture_sizes,
    decode_graph_mode,
    resolve_capture_sizes,
)
from servelm.worker.kv_cache import allocate_kv_caches
from servelm.worker.kv_offload import KVOffloader
from servelm.worker.model_runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 32  # the padding block is block 32
BLOCKS_PER_REQUEST = 4  # request i owns blocks 4i .. 4i+3 in the runner-level tests: 16 tokens each


class RecordingTorchBackend(TorchAttentionBackend):
    """The torch backend, recording every plan asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.num_builds = 0  # build_metadata calls, those made by build_decode_metadata included
        self.decode_builds: list[list[int]] = []  # per build_decode_metadata call: the seq_lens it read

    def build_metadata(self, common: CommonAttentionInputs) -> TorchAttentionMetadata:
        self.num_builds += 1
        return super().build_metadata(common)

    def build_decode_metadata(self, buffers: DecodeGraphBuffers, batch: int, *, dtype, kv_dtype):
        self.decode_builds.append(buffers.seq_lens[:batch].tolist())
        return super().build_decode_metadata(buffers, batch, dtype=dtype, kv_dtype=kv_dtype)

    @property
    def num_eager_builds(self) -> int:
        return self.num_builds - len(self.decode_builds)


register_backend("test-recording-torch", RecordingTorchBackend)


# -- buckets and modes ---------------------------------------------------------------------


def test_capture_sizes_are_vllms_buckets_closed_by_the_largest():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = capture_sizes(300)
    assert sizes[:5] == (1, 2, 4, 8, 16) and (240, 248, 256, 272, 288, 300) == sizes[-6:]
    assert resolve_capture_sizes(CudaGraphConfig(), max_num_seqs=128)[-1] == 128
    assert resolve_capture_sizes(CudaGraphConfig(), max_num_seqs=4096)[-1] == 512
    assert resolve_capture_sizes(CudaGraphConfig(max_cudagraph_capture_size=16), max_num_seqs=6) == (1, 2, 4, 6)
    with pytest.raises(ValueError, match="positive"):
        CudaGraphConfig(max_cudagraph_capture_size=0)


def test_vllm_flags_set_the_graph_settings():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    settings = engine_config_from_args(parser.parse_args(["--enforce-eager", "--max-cudagraph-capture-size", "16"]))
    assert settings.cuda_graphs == CudaGraphConfig(enforce_eager=True, max_cudagraph_capture_size=16)
    assert engine_config_from_args(parser.parse_args([])).cuda_graphs == CudaGraphConfig()


class CapturableTorchBackend(TorchAttentionBackend):
    graph_capturable = True  # only the flag: decode_graph_mode reads nothing else


def test_mode_graphs_on_cuda_with_a_capturable_backend_else_off_unless_forced():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    default, forced = CudaGraphConfig(), CudaGraphConfig(force_decode_buffers=True)
    assert decode_graph_mode(default, cuda, CapturableTorchBackend()) is DecodeGraphMode.CAPTURE
    assert decode_graph_mode(forced, cuda, CapturableTorchBackend()) is DecodeGraphMode.CAPTURE
    assert decode_graph_mode(CudaGraphConfig(enforce_eager=True), cuda, CapturableTorchBackend()) is DecodeGraphMode.OFF
    assert decode_graph_mode(default, cuda, TorchAttentionBackend()) is DecodeGraphMode.OFF
    assert decode_graph_mode(default, cpu, CapturableTorchBackend()) is DecodeGraphMode.OFF
    assert decode_graph_mode(forced, cpu, TorchAttentionBackend()) is DecodeGraphMode.EAGER_BUFFERS
    with pytest.raises(ValueError, match="build_decode_metadata"):
        decode_graph_mode(forced, cpu, object())
    with pytest.raises(ValueError, match="at most one"):
        CudaGraphConfig(enforce_eager=True, force_decode_buffers=True)


# -- the runner, driven step by step -------------------------------------------------------


@dataclass
class Harness:
    """A ModelRunner driven with hand-built SchedulerOutputs (fixed blocks per request, no scheduler)."""

    runner: ModelRunner
    backend: RecordingTorchBackend
    tokens: dict[str, list[int]] = field(default_factory=dict)  # prompt + sampled
    computed: dict[str, int] = field(default_factory=dict)  # tokens with K/V in the pool
    unseen: dict[str, list[int]] = field(default_factory=dict)  # sampled, not yet sent back as a diff

    @property
    def graphs(self) -> DecodeGraphRunner | None:
        return self.runner.decode_graphs

    def prefill(self, prompts: dict[str, list[int]], **params) -> None:
        new = []
        for rid, prompt in prompts.items():
            index = len(self.tokens)
            blocks = list(range(index * BLOCKS_PER_REQUEST, (index + 1) * BLOCKS_PER_REQUEST))
            sampling = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, **params)
            new.append(NewRequestData(rid, list(prompt), [], sampling, blocks, num_computed_tokens=0))
            self.tokens[rid] = list(prompt)
        num_tokens = {rid: len(prompt) for rid, prompt in prompts.items()}
        self._step(SchedulerOutput(new, [], num_tokens, sum(num_tokens.values())))

    def decode(self, request_ids: list[str], transfers: KVTransfers | None = None) -> None:
        diffs = [CachedRequestData(rid, self.unseen.pop(rid, []), [], self.computed[rid]) for rid in request_ids]
        so = SchedulerOutput([], diffs, dict.fromkeys(request_ids, 1), len(request_ids))
        self._step(dataclasses.replace(so, kv_transfers=transfers or KVTransfers()))

    def _step(self, so: SchedulerOutput) -> None:
        output = self.runner.execute(so)
        for rid, num_tokens in so.num_scheduled_tokens.items():
            self.computed[rid] = self.computed.get(rid, 0) + num_tokens
            self.tokens[rid].extend(output.sampled_token_ids[rid])
            self.unseen.setdefault(rid, []).extend(output.sampled_token_ids[rid])


@pytest.fixture(scope="module")
def checkpoint(tiny_dir):
    return load_checkpoint(tiny_dir)


def _harness(checkpoint, graphs: bool, sizes: tuple[int, ...] = (1, 2, 4), offloader: bool = False) -> Harness:
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu", "test-recording-torch")
    backend = model.decoder_layers[0].self_attn.backend
    assert isinstance(backend, RecordingTorchBackend)
    kv = allocate_kv_caches(checkpoint.arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu"),
                            padding_block=graphs)  # fmt: skip
    max_model_len = BLOCKS_PER_REQUEST * BLOCK_SIZE
    decode_graphs = None
    if graphs:
        decode_graphs = DecodeGraphRunner(model, kv, DecodeGraphMode.EAGER_BUFFERS, sizes, BLOCKS_PER_REQUEST,
                                          BLOCK_SIZE, padding_block_id=NUM_BLOCKS)  # fmt: skip
    runner = ModelRunner(model, kv, BLOCK_SIZE, (), torch.device("cpu"), max_num_seqs=8, max_model_len=max_model_len,
                         decode_graphs=decode_graphs,
                         kv_offloader=KVOffloader(block_tensors(kv), disk_store=None) if offloader else None)  # fmt: skip
    return Harness(runner, backend)


PROMPTS = {"a": [5, 6, 7, 8, 9], "b": list(range(40, 49)), "c": [3, 1, 4], "d": [2, 7], "e": [11, 12, 13, 14]}


def test_real_rows_hold_the_step_and_padding_rows_the_padding_block(checkpoint):
    h, eager = _harness(checkpoint, graphs=True), _harness(checkpoint, graphs=False)
    for run in (h, eager):
        run.prefill({rid: PROMPTS[rid] for rid in "abc"})
        run.decode(["a", "b", "c"])  # 3 rows → bucket 4: one padding row
    assert h.graphs is not None and h.graphs.stats().steps == {4: 1}
    buffers = h.graphs.buffers
    pad = NUM_BLOCKS
    lens = [len(PROMPTS[rid]) for rid in "abc"]  # the decode token's position
    assert buffers.input_ids[:3].tolist() == [h.tokens[rid][n] for rid, n in zip("abc", lens)]
    assert buffers.positions[:3].tolist() == lens
    assert buffers.seq_lens[:3].tolist() == [n + 1 for n in lens]
    # request i owns blocks 4i..4i+3: position p sits in block 4i + p // 4, offset p % 4
    assert buffers.slot_mapping[:3].tolist() == [(4 * i + n // 4) * BLOCK_SIZE + n % 4 for i, n in enumerate(lens)]
    # Each row holds its request's blocks up to the columns the batch's longest row reaches, then padding.
    width = max(-(-(n + 1) // BLOCK_SIZE) for n in lens)
    for i in range(3):
        own = list(range(4 * i, 4 * i + width))
        assert buffers.block_table[i].tolist() == own + [pad] * (BLOCKS_PER_REQUEST - width)
    assert buffers.input_ids[3].item() == 0 and buffers.positions[3].item() == 0
    assert buffers.seq_lens[3].item() == 1 and buffers.slot_mapping[3].item() == pad * BLOCK_SIZE
    assert buffers.block_table[3].tolist() == [pad] * BLOCKS_PER_REQUEST
    # The padding row wrote its K/V into the padding block, the real rows theirs: the same tokens come out.
    assert h.runner.kv_caches[0][:, pad].abs().sum() > 0
    assert h.tokens == eager.tokens


def test_buffers_are_reused_across_steps_and_batch_sizes(checkpoint):
    h = _harness(checkpoint, graphs=True)
    assert h.graphs is not None
    buffers = h.graphs.buffers
    pointers = [t.data_ptr() for t in (buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens,
                                       buffers.block_table)]  # fmt: skip
    h.prefill({rid: PROMPTS[rid] for rid in "abcd"})
    for batch in (["a"], ["a", "b", "c"], ["b", "d"], ["a", "b", "c", "d"], ["c"]):
        h.decode(batch)
    assert h.graphs.buffers is buffers
    assert [t.data_ptr() for t in (buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens,
                                   buffers.block_table)] == pointers  # fmt: skip
    assert buffers.input_ids.shape == (4,) and buffers.block_table.shape == (4, BLOCKS_PER_REQUEST)
    assert h.graphs.stats().steps == {1: 2, 4: 2, 2: 1}


def test_steps_that_are_not_plain_decodes_within_the_largest_bucket_run_eagerly(checkpoint):
    h = _harness(checkpoint, graphs=True)
    assert h.graphs is not None
    h.prefill({rid: PROMPTS[rid] for rid in "abcde"})  # a prefill: eager
    assert h.backend.num_eager_builds == 1 and not h.graphs.stats().steps
    h.decode(["a", "b", "c", "d", "e"])  # 5 decodes, the largest bucket is 4: eager
    assert h.backend.num_eager_builds == 2 and not h.graphs.stats().steps
    h.decode(["a", "b", "c", "d"])
    assert h.backend.num_eager_builds == 2 and h.graphs.stats().steps == {4: 1}
    h.prefill({"f": [1, 2, 3]}, prompt_logprobs=1)
    h.decode(["f"])  # a request asking for prompt logprobs never takes the graph path
    assert h.backend.num_eager_builds == 4 and h.graphs.stats().steps == {4: 1}


def test_metadata_is_built_again_from_the_buffers_after_every_refill(checkpoint):
    h, eager = _harness(checkpoint, graphs=True), _harness(checkpoint, graphs=False)
    for run in (h, eager):
        run.prefill({"a": PROMPTS["a"], "b": PROMPTS["b"]})
        for _ in range(3):
            run.decode(["a", "b"])
        run.decode(["b"])
    # One plan per decode step, each read from that step's refilled buffers (context grows by one).
    assert h.backend.decode_builds == [[6, 10], [7, 11], [8, 12], [13]]
    assert h.backend.num_eager_builds == 1  # the prefill
    assert h.tokens == eager.tokens


def test_no_step_takes_the_graph_path_while_a_kv_load_is_in_flight(checkpoint):
    h = _harness(checkpoint, graphs=True, offloader=True)
    offloader, graphs = h.runner.kv_offloader, h.graphs
    assert offloader is not None and graphs is not None
    try:
        h.prefill({"a": PROMPTS["a"], "b": PROMPTS["b"]})
        host = (KVMedium.HOST,)
        h.decode(["a", "b"], KVTransfers(saves=[KVSave(0, b"block-0", host)]))  # a save does not matter
        assert graphs.stats().steps == {2: 1}
        # Block 0 loaded back into block 31 for a request still waiting for it (no request reads 31).
        h.decode(["a", "b"], KVTransfers(loads=[KVLoad("waiting", [31], [b"block-0"], list(host))]))
        assert graphs.stats().steps == {2: 1} and h.backend.num_eager_builds == 2
        deadline = time.monotonic() + 10
        while offloader.has_loads_in_flight:  # steps with nothing to compute collect the load's result
            assert time.monotonic() < deadline, "the load did not end"
            h.runner.execute(SchedulerOutput([], [], {}, 0))
        h.decode(["a", "b"])
        assert graphs.stats().steps == {2: 2}
        assert torch.equal(h.runner.kv_caches[0][:, 31], h.runner.kv_caches[0][:, 0])
    finally:
        offloader.close()


# -- the engine ----------------------------------------------------------------------------


def _workload() -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, arrival step): requests join and leave while others decode."""
    rng = random.Random(5)
    return [
        ([rng.randrange(1000) for _ in range(rng.randint(2, 30))], rng.randint(3, 18), rng.randint(0, 24))
        for _ in range(13)
    ]


def _run_engine(tiny_dir, workload, **graph_settings):
    # 24 blocks of 4 = 96 token slots for up to 10 requests of up to 48 tokens: preemptions. No
    # step-time target: its budget follows measured step times (the interpreter's are seconds), and
    # the pools are compared block for block, so both engines must schedule the same.
    config = EngineConfig.from_flat(model=str(tiny_dir), device="cpu", num_blocks=24, block_size=BLOCK_SIZE,
                                    max_num_batched_tokens=48, max_num_seqs=10, max_cudagraph_capture_size=8,
                                    max_step_ms=0.0, **graph_settings)  # fmt: skip
    core = build_engine(config).core
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(workload))}
    finished: set[str] = set()
    max_block_id = -1
    step = 0
    while len(finished) < len(workload):
        for i, (prompt, max_tokens, arrival) in enumerate(workload):
            if arrival == step:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                core.add_request(EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params))
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished.add(output.request_id)
        core.kv_manager.check_invariants()
        max_block_id = max(max_block_id, int(core.runner.block_table.table.max()))  # what the scheduler handed out
        step += 1
        assert step < 1000, "the engine did not finish the workload"
    return core, tokens, max_block_id


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_with_the_graph_path_matches_the_engine_without(tiny_dir, backend):
    """torch: metadata rebuilt from every refill. triton (interpreter): graph_capturable, so one
    metadata per bucket is built once and reused across refills, as a captured graph replays it."""
    workload = _workload()
    eager_core, eager_tokens, _ = _run_engine(tiny_dir, workload, enforce_eager=True, attention_backend="torch")
    core, tokens, max_block_id = _run_engine(tiny_dir, workload, force_decode_buffers=True,
                                             attention_backend=backend)  # fmt: skip
    assert eager_core.runner.decode_graphs is None
    graphs = core.runner.decode_graphs
    assert graphs is not None and graphs.backend.graph_capturable == (backend == "triton")
    assert tokens == eager_tokens
    assert core.stats().num_preemptions > 0 and core.stats().num_preemptions == eager_core.stats().num_preemptions
    steps = graphs.stats().steps
    assert {1, 2, 4, 8} <= set(steps), f"the batch was meant to cross every bucket: {steps}"

    # The padding block (id 24) is the pool's last, past every block the scheduler has.
    pad = graphs.buffers.padding_block_id
    assert pad == core.kv_manager.num_blocks == 24 and max_block_id < pad
    for layer, eager_layer in zip(core.runner.kv_caches, eager_core.runner.kv_caches, strict=True):
        assert isinstance(layer, torch.Tensor) and isinstance(eager_layer, torch.Tensor)
        assert layer.shape[1] == pad + 1 and eager_layer.shape[1] == pad
        # Real blocks: the same K/V (up to float rounding: a padded batch's matmuls have another shape).
        torch.testing.assert_close(layer[:, :pad], eager_layer, rtol=1e-5, atol=1e-5)
        assert bool((layer[:, :pad] != 0).any(dim=(0, 2, 3, 4)).eq((eager_layer != 0).any(dim=(0, 2, 3, 4))).all())
    assert core.runner.kv_caches[0][:, pad].abs().sum() > 0, "padding rows were meant to write the padding block"
