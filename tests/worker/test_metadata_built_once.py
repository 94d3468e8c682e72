"""The runner asks the backend for its metadata exactly once per step; every layer reads that one.

The model's backend is the real torch backend, subclassed only to count calls; the
engine (scheduler, runner, KV pool) is real, on a workload that mixes chunked prefills,
decodes and a prefix hit.
"""

from __future__ import annotations

import torch

from servelm.attention.backend import AttentionMetadata, CommonAttentionInputs, register_backend
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import assemble_engine
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.sampling_params import SamplingParams
from servelm.testing.reference_decode import greedy_decode
from servelm.testing.tiny_model import write_tiny_checkpoint

NUM_LAYERS = 3


class CountingTorchBackend(TorchAttentionBackend):
    def __init__(self) -> None:
        super().__init__()
        self.built: list[AttentionMetadata] = []
        self.forwards_per_build: list[int] = []

    def build_metadata(self, common: CommonAttentionInputs) -> AttentionMetadata:
        metadata = super().build_metadata(common)
        self.built.append(metadata)
        self.forwards_per_build.append(0)
        return metadata

    def forward(self, query, key, value, kv_cache, metadata, scale):
        assert metadata is self.built[-1], "a layer got metadata other than this step's"
        self.forwards_per_build[-1] += 1
        return super().forward(query, key, value, kv_cache, metadata, scale)


register_backend("test-counting-torch", CountingTorchBackend)


def test_one_build_per_step_and_one_forward_per_layer(tmp_path):
    checkpoint = load_checkpoint(write_tiny_checkpoint(tmp_path / "model", seed=2, num_hidden_layers=NUM_LAYERS))
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu", "test-counting-torch")
    backend = model.layers[0].self_attn.backend
    assert isinstance(backend, CountingTorchBackend)
    # Steps of whole tokens: without a time target (max_step_ms 0) no prompt runs as layered slices, whose
    # layers build their own metadata. With the calibrated default, a start on a loaded machine (the
    # suite on two workers) once priced this tiny model's steps so that some prompts ran by layers, and
    # 46 builds met 42 steps.
    config = EngineConfig.from_flat(
        model="unused", num_blocks=64, block_size=4, max_num_batched_tokens=24, enable_prefix_caching=True, max_step_ms=0
    )
    core = assemble_engine(config, model, checkpoint.arch, checkpoint.tokenizer, "test").core
    num_warmup_steps = len(backend.built)  # the start-up warm-up's steps (worker/warmup.py) are steps too
    shared = list(range(300, 320))
    prompts = {"a": shared + [5, 6, 7], "b": list(range(40, 71)), "c": shared + [9]}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params))
        for output in core.step():  # requests arrive while others run: mixed prefill/decode steps
            tokens[output.request_id].extend(output.new_token_ids)
    while core.has_work():
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)

    steps_with_tokens = len(core.take_step_records())
    assert steps_with_tokens > len(prompts)
    assert len(backend.built) == num_warmup_steps + steps_with_tokens
    assert backend.forwards_per_build == [NUM_LAYERS] * (num_warmup_steps + steps_with_tokens)
    assert core.stats().prefix_hits > 0
    reference = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu")
    for rid, prompt in prompts.items():
        assert tokens[rid] == greedy_decode(reference, prompt, 6), rid
