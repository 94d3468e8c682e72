"""DraftScheduling: what the proposer's measured time does to k (the controller charges it)."""

from __future__ import annotations

from servelm.config import SpeculativeConfig
from servelm.sampling_params import SamplingParams
from servelm.scheduler.drafts import DraftScheduling
from servelm.scheduler.request import Request

STEP_FIT = (0.03, 0.0005)  # (fixed seconds, seconds per token): a small model's decode on a CPU


def decoding_request(draft_token_ids: list[int]) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=100), priority=0,
                      arrival_time=0.0, arrival_seq=0)  # fmt: skip
    request.draft_token_ids = draft_token_ids
    return request


def half_accepted(drafts: DraftScheduling, request: Request) -> None:
    for _ in range(100):
        drafts.verified(request, 2, 1)  # acceptance 0.5


def test_a_proposer_as_slow_as_a_step_gets_no_drafts_verified() -> None:
    request = decoding_request([7, 8, 9])
    lookup = DraftScheduling(SpeculativeConfig(method="ngram", num_speculative_tokens=3), max_model_len=1024)
    half_accepted(lookup, request)
    for _ in range(20):
        lookup.proposed(0.00002, 3)  # a lookup: microseconds per draft
    assert lookup.choose([request], STEP_FIT) == {"r": 3}

    draft_model = DraftScheduling(SpeculativeConfig(method="ngram", num_speculative_tokens=3), max_model_len=1024)
    half_accepted(draft_model, request)
    for _ in range(20):
        draft_model.proposed(0.09, 3)  # 30 ms per draft: a forward as dear as the target's step
    assert draft_model.choose([request], STEP_FIT) == {"r": 0}


def test_catch_up_time_without_drafts_is_spread_over_the_drafts_that_follow() -> None:
    drafts = DraftScheduling(SpeculativeConfig(method="ngram", num_speculative_tokens=3), max_model_len=1024)
    drafts.proposed(0.2, 0)  # a separate draft model reading a prompt: no drafts yet
    drafts.proposed(0.0, 0)  # nothing proposed, nothing learned
    drafts.proposed(0.01, 2)
    assert abs(drafts.propose_cost.per_draft_s - (0.95 * 0.2 + 0.01) / 2) < 1e-12
