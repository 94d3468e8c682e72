"""The goodput controller: how many draft tokens each request verifies this step (k, 0 allowed).

Contract (implemented in this module; the scheduler is the one caller):

    controller = SpecController(max_k=config.num_speculative_tokens, adaptive=config.adaptive)
    ks = controller.choose(offers, num_step_tokens, cost)   # in schedule(), once per step
    controller.observe(request_id, num_drafted, num_accepted)  # in update(), per verified request
    controller.forget(request_id)                           # request finished / preempted

- `offers`: requests that hold drafts this step, each with how many it may verify
  (`DraftOffer.num_available`, already capped by max_tokens, the context window, the API's
  per-request override and max_k).
- `num_step_tokens`: tokens the step carries without any draft (its decodes, plus prefill chunks
  when the scheduler knows them).
- `cost`: the scheduler's step-cost fit (seconds = fixed + per_token × tokens), None before it has one.
- Returns {request_id: k} with 0 <= k <= num_available for every offer (missing = 0).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftOffer:
    request_id: str
    num_available: int  # drafts on hand it may verify this step (>= 1)


@dataclass(frozen=True)
class StepCost:
    fixed_s: float  # seconds a step costs whatever its size
    per_token_s: float  # seconds each scheduled token adds
