"""The Proposer interface: draft tokens for requests that just sampled.

Called by the ModelRunner once per step, after sampling, with every request that sampled a
token this step and may speculate; the drafts go back to the scheduler in ModelOutput. A
proposer never changes what the target emits: verification (verify.py) accepts only drafts
that the target's own samples agree with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from servelm.config import SpeculativeConfig
from servelm.spec.ngram import NgramProposer
from servelm.spec.suffix import SuffixProposer


@dataclass(frozen=True)
class DraftRequest:
    """One request to propose for."""

    request_id: str
    # prompt + every output token so far, the newest (this step's) last. A view: do not mutate.
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_draft_tokens: int  # propose at most this many (>= 1)

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if not 0 <= self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(
                f"request {self.request_id}: num_prompt_tokens {self.num_prompt_tokens} is outside "
                f"0..{len(self.token_ids)} (the number of token_ids)"
            )


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


# The token-only methods; "draft" needs the engine's model and KV and is built by the worker.
_REGISTRY: dict[str, Callable[[SpeculativeConfig], Proposer]] = {
    "ngram": lambda config: NgramProposer(config.lookup_min, config.lookup_max, config.num_speculative_tokens),
    "suffix": lambda config: SuffixProposer(config.num_speculative_tokens, config.suffix_max_cached_requests),
}


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer for a token-only method; ValueError naming the valid ones for any other."""
    factory = _REGISTRY.get(config.method)
    if factory is None:
        raise ValueError(
            f"build_proposer builds {', '.join(sorted(_REGISTRY))}, not {config.method!r} "
            "(a draft-model proposer is built with the model runner)"
        )
    return factory(config)
