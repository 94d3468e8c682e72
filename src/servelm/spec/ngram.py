"""Prompt lookup (vLLM's "ngram" method): propose what followed the request's last n tokens before.

Per request and step, over token_ids = prompt + output (newest last):

    1. continue the previous copy (CopyCursor) if the tokens appended since equal its source's;
    2. else for n = lookup_max down to lookup_min: an earlier occurrence of the last n tokens
       (NgramIndex: of several, the one whose preceding tokens agree longest with the request's,
       the earliest on a tie); propose the tokens that followed it, running into the drafts
       themselves when the occurrence is less than k tokens back (a loop);
    3. else no proposal.
    At most min(max_k, max_draft_tokens) tokens.

Step 2 with the earliest occurrence and no overlap is vLLM's semantics. Chosen on the greedy
code-edit outputs of benchmarks/speculative.py (the default model, four files, 1,024 output tokens
each, k = 5, lookup 2..5; /tmp replay of the recorded outputs), mean output tokens per step:

    earliest + cursor (vLLM's lookup + cursor)    3.51   acceptance per position 0.91 / 0.50 / 0.48 / 0.46 / 0.45
    + longest context agreement                   3.96   0.90 / 0.85 / 0.55 / 0.52 / 0.51
    + overlapping copies                          4.49   0.89 / 0.82 / 0.79 / 0.76 / 0.75

The model's copies are imperfect (~90% of characters verbatim) and fall into loops
("a_stream_stream_stream"): the earliest "stream _ stream" is followed by ":" in the prompt and is
found again after every rejection; the loop's own previous period agrees for the whole loop.
Earlier, on exact simulated copies (the file returned renamed, a line inserted or changed):
earliest 5.08, latest 4.93, either + cursor 5.45 tokens/step.

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
