"""Disaggregation inside one test process: a producer engine and a consumer engine on the tiny
model, stepped in turn, the KV crossing between them over the real transfer (ZMQ on 127.0.0.1).

The consumer's greedy tokens equal the single-sequence reference for every request, with chunked
prefills on both sides, preemption on the consumer (a small pool), prefix hits on both sides
(prompts sharing a prefix), and KV invariants checked after every step of either engine; at the
end both pools are empty and the producer holds no export."""

from __future__ import annotations

import random

import pytest

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest, KVMedium, KVTransferParams, KVTransferRole
from servelm.engine.builder import BuiltEngine, build_engine
from servelm.sampling_params import SamplingParams
from servelm.testing.reference_decode import greedy_decode

MAX_STEPS = 20_000


@pytest.fixture(scope="module")
def engines(tiny_dir):
    producer = build_engine(
        EngineConfig.from_flat(
            model=str(tiny_dir), num_blocks=160, block_size=16, max_num_batched_tokens=48, kv_role="prefill",
            kv_transfer_hold_s=5.0,
        )
    )  # fmt: skip
    address = producer.kv_transfer_address
    assert address is not None and address.startswith("tcp://127.0.0.1:")
    consumer = build_engine(
        EngineConfig.from_flat(
            model=str(tiny_dir), num_blocks=48, block_size=16, max_num_batched_tokens=64, max_num_seqs=8, max_step_ms=0,
            kv_role="decode", kv_transfer_wait_s=2.0, kv_transfer_peers=(address,),
        )
    )  # fmt: skip
    yield producer, consumer, address
    for built in (producer, consumer):
        built.core.close()


def test_consumer_greedy_output_is_the_reference(engines, reference_model):
    producer, consumer, address = engines
    rng = random.Random(14)
    shared = [rng.randrange(1, 1000) for _ in range(40)]
    prompts = [
        (shared if i % 3 == 0 else []) + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 260))] for i in range(18)
    ]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    arrivals = [rng.randint(0, 30) for _ in prompts]
    expected = [greedy_decode(reference_model, p, n) for p, n in zip(prompts, max_tokens)]

    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    step = 0
    while len(finished) < len(prompts):
        for i, (prompt, n, arrival) in enumerate(zip(prompts, max_tokens, arrivals)):
            if arrival == step:
                transfer_id = f"t{i}"
                producer.core.add_request(_request(f"p{i}", prompt, 1, KVTransferParams(
                    transfer_id=transfer_id, role=KVTransferRole.PRODUCER)))  # fmt: skip
                consumer.core.add_request(_request(str(i), prompt, n, KVTransferParams(
                    transfer_id=transfer_id, role=KVTransferRole.CONSUMER, peer=address)))  # fmt: skip
        producer.core.step()
        for output in consumer.core.step():
            got[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished.add(output.request_id)
        for built in (producer, consumer):
            built.core.scheduler.check_invariants()
        step += 1
        assert step < MAX_STEPS, "the engines did not finish the workload"

    for i, want in enumerate(expected):
        assert got[str(i)] == want, f"request {i} diverged from the reference"
    stats = consumer.core.stats()
    assert stats.tiers.hits[KVMedium.REMOTE.value] > 0, "nothing was pulled"
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0, "the workload was meant to preempt and hit"
    assert stats.num_used_blocks == 0 and stats.tiers.num_pulling == 0
    _step_until_no_exports(producer)
    assert producer.core.stats().num_used_blocks == 0


def _step_until_no_exports(producer: BuiltEngine) -> None:
    """Served exports are let go when the producer's runner reports them (a step); the rest expire."""
    for _ in range(MAX_STEPS):
        if not producer.core.has_housekeeping():
            return
        producer.core.step()
    pytest.fail("the producer still holds exports")


def _request(request_id: str, prompt: list[int], max_tokens: int, params: KVTransferParams) -> EngineRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling, kv_transfer=params)
