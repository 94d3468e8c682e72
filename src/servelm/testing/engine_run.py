"""Drive an EngineCore through a workload step by step, as the exactness tests do.

Requests join at their arrival steps; every step's outputs are collected per request and the
scheduler's invariants (KV included) are checked after each step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from servelm.datatypes import EngineRequest, FinishReason, LayerSlice, PositionLogprobs, RequestEvent, SchedulerOutput
from servelm.engine.core import EngineCore
from servelm.models.llama import LlamaForCausalLM
from servelm.sampling_params import SamplingParams
from servelm.scheduler.scheduler import Scheduler
from servelm.testing.reference_decode import greedy_decode

MAX_STEPS = 20_000


@dataclass
class EngineRun:
    tokens: dict[str, list[int]]
    logprobs: dict[str, list[PositionLogprobs]]
    finish: dict[str, FinishReason]
    events: dict[str, list[RequestEvent]]
    num_steps: int


def run_requests(core: EngineCore, requests: Sequence[EngineRequest], arrivals: Sequence[int]) -> EngineRun:
    """Add requests[i] at step arrivals[i]; step until every request finished (AssertionError after
    MAX_STEPS); check the scheduler's invariants after every step."""
    run = EngineRun(
        tokens={r.request_id: [] for r in requests},
        logprobs={r.request_id: [] for r in requests},
        finish={},
        events={r.request_id: [] for r in requests},
        num_steps=0,
    )
    while len(run.finish) < len(requests):
        for request, arrival in zip(requests, arrivals):
            if arrival == run.num_steps:
                core.add_request(request)
        for output in core.step():
            run.tokens[output.request_id].extend(output.new_token_ids)
            run.logprobs[output.request_id].extend(output.new_logprobs or [])
            run.events[output.request_id].extend(output.events)
            if output.finish_reason is not None:
                run.finish[output.request_id] = output.finish_reason
        core.scheduler.check_invariants()
        run.num_steps += 1
        assert run.num_steps < MAX_STEPS, "engine did not finish the workload"
    return run


def prefix_sharing_prompts(rng: random.Random, count: int, vocab: int, shared_len: int, max_body: int) -> list[list[int]]:
    """`count` random prompts of token ids below `vocab`, 1..max_body tokens each after, for every
    third, one shared `shared_len`-token prefix: the workload hits the prefix cache."""
    shared = [rng.randrange(vocab) for _ in range(shared_len)]
    return [
        (shared if i % 3 == 0 else []) + [rng.randrange(vocab) for _ in range(rng.randint(1, max_body))]
        for i in range(count)
    ]


def greedy_requests(prompts: Sequence[list[int]], max_tokens: Sequence[int]) -> list[EngineRequest]:
    """Request i (id "i"): prompts[i], greedy, exactly max_tokens[i] tokens (EOS ignored)."""
    return [
        EngineRequest(
            request_id=str(i),
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        )
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True))
    ]


@dataclass(frozen=True)
class ReferenceWorkload:
    """Requests for run_requests with the single-sequence reference's greedy outputs."""

    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[int]  # the step each request joins
    expected: list[list[int]]  # greedy_decode of each prompt


def reference_workload(
    model: LlamaForCausalLM, seed: int, count: int, shared_len: int, max_body: int, max_output: int, max_arrival: int
) -> ReferenceWorkload:
    """prefix_sharing_prompts with random output lengths (1..max_output) and arrival steps
    (0..max_arrival), and what `model` decodes greedily for each, one sequence at a time."""
    rng = random.Random(seed)
    prompts = prefix_sharing_prompts(rng, count, model.arch.vocab_size, shared_len, max_body)
    max_tokens = [rng.randint(1, max_output) for _ in prompts]
    arrivals = [rng.randint(0, max_arrival) for _ in prompts]
    expected = [greedy_decode(model, prompt, n) for prompt, n in zip(prompts, max_tokens, strict=True)]
    return ReferenceWorkload(prompts, max_tokens, arrivals, expected)


def record_layer_slices(scheduler: Scheduler) -> list[LayerSlice]:
    """The layer slices of every step the real scheduler plans from now on (it watches, changes nothing)."""
    slices: list[LayerSlice] = []
    schedule = scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        so = schedule()
        slices.extend(so.layer_slices.values())
        return so

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return slices


def assert_same_run(got: EngineRun, want: EngineRun, rtol: float = 1e-4) -> None:
    """The same greedy tokens, and at every position the same top-logprob tokens with logprobs within
    `rtol` (relative, absolute below 1): two paths that compute the same float32 values up to the order
    of a few sums."""
    assert got.tokens == want.tokens
    for request_id, positions in want.logprobs.items():
        for mine, theirs in zip(got.logprobs[request_id], positions, strict=True):
            assert [t.token_id for t in mine.top] == [t.token_id for t in theirs.top]
            for a, b in zip(mine.top, theirs.top, strict=True):
                assert abs(a.logprob - b.logprob) <= rtol * max(1.0, abs(b.logprob)), (request_id, a, b)
