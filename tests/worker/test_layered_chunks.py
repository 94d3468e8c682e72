"""Layered prefill in the runner (worker/layered_chunks.py): a chunk's forward spread over several steps
by layers gives the same logits as the chunk in one forward, next to other requests' steps; its
state is dropped with the request; a slice that does not continue the chunk held is refused."""

from __future__ import annotations

import pytest
import torch

from servelm.config import EngineConfig
from servelm.datatypes import LayerSlice, NewRequestData, SchedulerOutput
from servelm.engine.builder import build_engine
from servelm.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)


def _runner(tiny_dir):
    return build_engine(EngineConfig.from_flat(model=str(tiny_dir), num_blocks=64, block_size=16)).core.runner


def _new(request_id: str, prompt: list[int], first_block: int, num_computed: int = 0) -> NewRequestData:
    num_blocks = -(-(len(prompt) + 1) // 16)
    return NewRequestData(request_id, prompt, [], PARAMS, list(range(first_block, first_block + num_blocks)), num_computed)


def test_a_chunk_in_layer_slices_samples_what_one_forward_samples(tiny_dir) -> None:
    runner = _runner(tiny_dir)
    num_layers = len(runner.model.decoder_layers)
    assert num_layers >= 2
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    whole = runner.execute(SchedulerOutput([_new("whole", prompt, 0)], [], {"whole": 40}, 40))
    other = [(5 * i) % 200 + 3 for i in range(9)]
    # Layer by layer, while another request's prompt runs in the same steps.
    first = SchedulerOutput([_new("sliced", prompt, 8), _new("other", other, 16)], [], {"other": 9}, 9,
                            layer_slices={"sliced": LayerSlice(40, 0, 1)})  # fmt: skip
    out = runner.execute(first)
    assert "sliced" not in out.sampled_token_ids and out.sampled_token_ids["other"]
    for start in range(1, num_layers - 1):
        runner.execute(SchedulerOutput([], [], {}, 0, layer_slices={"sliced": LayerSlice(40, start, start + 1)}))
    last = runner.execute(SchedulerOutput([], [], {"sliced": 40}, 40,
                                          layer_slices={"sliced": LayerSlice(40, num_layers - 1, num_layers)}))  # fmt: skip
    assert last.sampled_token_ids["sliced"] == whole.sampled_token_ids["whole"]
    got, want = last.logprobs["sliced"][0], whole.logprobs["whole"][0]
    assert [t.token_id for t in got.top] == [t.token_id for t in want.top]
    torch.testing.assert_close(torch.tensor([t.logprob for t in got.top]), torch.tensor([t.logprob for t in want.top]))
    assert len(runner.layered_chunks) == 0  # the completed chunk is not held


def test_a_chunk_is_dropped_with_its_request_and_a_slice_out_of_order_is_refused(tiny_dir) -> None:
    runner = _runner(tiny_dir)
    prompt = list(range(3, 35))
    runner.execute(SchedulerOutput([_new("r", prompt, 0)], [], {}, 0, layer_slices={"r": LayerSlice(32, 0, 1)}))
    assert len(runner.layered_chunks) == 1
    with pytest.raises(ValueError, match="does not continue the chunk"):
        runner.layered_chunks.run(runner.requests["r"], LayerSlice(32, 2, 3))
    runner.execute(SchedulerOutput([], [], {}, 0, preempted_request_ids={"r"}))
    assert len(runner.layered_chunks) == 0 and "r" not in runner.requests
