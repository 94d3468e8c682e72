"""The Proposer interface: draft tokens for requests that just sampled.

Called by the ModelRunner once per step, after sampling, with every request that sampled a
token this step and may speculate; the drafts go back to the scheduler in ModelOutput. A
proposer never changes what the target emits: verification (verify.py) accepts only drafts
that the target's own samples agree with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from servelm.config import SpeculativeConfig


@dataclass(frozen=True)
class DraftRequest:
    """One request to propose for."""

    request_id: str
    # prompt + every output token so far, the newest (this step's) last. A view: do not mutate.
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_draft_tokens: int  # propose at most this many (>= 1)


class Proposer(Protocol):
    """Contract: `propose` returns, per request id, 0..max_draft_tokens token ids (missing or empty:
    no guess). Deterministic given the same calls in the same order (greedy exactness and seeded
    sampling do not depend on it, but reproducible acceptance does). It may keep per-request state
    keyed by request id; `release` drops it (safe to call for unknown ids, and twice)."""

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]: ...

    def release(self, request_id: str, token_ids: Sequence[int] | None) -> None:
        """The request finished (`token_ids`: its prompt + output, which a cross-request index may
        keep) or was preempted/aborted (None: it may come back with the same id)."""
        ...


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer `config.method` names."""
    raise ValueError(f"speculative method {config.method!r} has no proposer yet")
