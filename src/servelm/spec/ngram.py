"""Prompt lookup (vLLM's "ngram" method): propose what followed the request's last n tokens before.

Per request and step, over token_ids = prompt + output (newest last):

    1. continue the previous copy (CopyCursor) if the tokens appended since equal its source's;
    2. else for n = lookup_max down to lookup_min: the earliest earlier occurrence of the last n
       tokens (NgramIndex); propose the tokens that followed it;
    3. else no proposal.
    At most min(max_k, max_draft_tokens) tokens.

Step 2 alone is vLLM's semantics. Step 1 and "earliest" were chosen on a simulation of greedy
decoding with k = 5 over code edits (the default model's tokenizer; four servelm source files of
1.4k-2.6k tokens, each returned renamed, with a line inserted, with a line changed, and in two-turn
prompts holding two versions), mean output tokens per step at lookup 5..5:

    earliest 5.08 (acceptance 0.89)    latest 4.93 (0.86)
    earliest + cursor 5.45 (0.98)      latest + cursor 5.44 (0.98)     (2..5: 5.72; 1..3: 5.73)

Cost per step: O(tokens appended × (lookup_max - lookup_min + 1)) to index, the same number of
dict lookups to propose; never a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from servelm.spec.token_match import CopyCursor, CopyDrafter, NgramIndex

if TYPE_CHECKING:  # proposer.py imports this module for its registry
    from servelm.spec.proposer import DraftRequest


class NgramProposer:
    """The Proposer for method "ngram" (see the module docstring for the algorithm).

    Keeps one index per request id until `release`; the ModelRunner is the only caller.
    """

    def __init__(self, lookup_min: int, lookup_max: int, max_k: int) -> None:
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"need 1 <= lookup_min <= lookup_max, got {lookup_min} and {lookup_max}")
        self._lengths = range(lookup_max, lookup_min - 1, -1)  # longest match first
        self._drafter = CopyDrafter(self._lengths, min_match=lookup_min, max_k=max_k, lookup=self._lookup)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        return self._drafter.propose(requests)

    def release(self, request_id: str, token_ids: Sequence[int] | None) -> None:
        self._drafter.forget(request_id)

    @property
    def num_requests(self) -> int:
        """Requests holding an index (tests: release forgets)."""
        return self._drafter.num_requests

    def _lookup(self, index: NgramIndex, token_ids: Sequence[int]) -> CopyCursor | None:
        for n in self._lengths:
            position = index.follower(token_ids, n)
            if position is not None:
                return CopyCursor(source=None, position=position, num_tokens=len(token_ids))
        return None
