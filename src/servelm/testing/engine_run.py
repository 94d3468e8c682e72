"""Drive an EngineCore through a workload step by step, as the exactness tests do.

Requests join at their arrival steps; every step's outputs are collected per request and the
scheduler's invariants (KV included) are checked after each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from servelm.datatypes import EngineRequest, FinishReason, PositionLogprobs, RequestEvent
from servelm.engine.core import EngineCore

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
