"""Suffix lookup across requests (method "suffix"): continue the longest match of the request's last
tokens in its own tokens or in the tokens of recently finished requests.

Agentic and code traffic repeats across requests (the same tool-call JSON, a file written by one
request and echoed by the next), which prompt lookup over one request cannot see. Per request and step:

    1. continue the previous copy (CopyCursor), from whichever source it came from;
    2. else for n in KEY_LENGTHS, longest first: an occurrence of the last n tokens in the
       request's own tokens (chosen as in ngram.py), else the most recent one in the finished-request
       index; the first hit wins. So the longer
       match wins wherever it is (more matched context, a more specific guess) and on equal length
       the request's own tokens win (the same conversation beats a stranger's);
    3. else no proposal: nothing shorter than MIN_MATCH tokens is trusted, so junk guesses on
       common short n-grams do not cost verification.

A suffix tree would give the exact longest match; fixed key lengths give it to within the gap
between two lengths, with O(tokens appended × len(KEY_LENGTHS)) work per step in plain Python.

Key lengths (16, 6, 3): on the code-edit simulation described in ngram.py (own tokens only) they
give 5.63 tokens/step, the same as (24, 12, 6, 3) with a quarter fewer entries; the shortest length
sets it (minimum 4: 5.54, minimum 2: 5.72, but 2-token matches are junk-prone on chat).

Bounded memory: the finished-request index keeps the last `max_tokens_per_cached_request` tokens of
at most `max_cached_requests` requests (oldest dropped first), so at most
max_cached_requests × max_tokens_per_cached_request × len(KEY_LENGTHS) entries: at the defaults
(256 × 1024 × 3, random tokens, no n-gram shared) 780k entries, about 90 MiB; release() of a finished
request indexes its tokens then and there, about 3 ms for 1,024 tokens on one core.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from servelm.spec.token_match import CopyCursor, CopyDrafter, NgramIndex, ngram_key, same_tokens

if TYPE_CHECKING:  # proposer.py imports this module for its registry
    from servelm.spec.proposer import DraftRequest

KEY_LENGTHS = (16, 6, 3)  # longest first
MIN_MATCH = KEY_LENGTHS[-1]


class FinishedTokenIndex:
    """n-gram → (finished request, follower position) of its most recent occurrence, bounded.

    `add` indexes the last `max_tokens_per_request` tokens of a finished request and drops the
    oldest request beyond `max_requests`, deleting the entries that still point into it. An entry
    still pointing into the oldest request means no newer one holds that n-gram, so the tables
    after a drop are exactly those of the kept requests alone.
    """

    def __init__(self, max_requests: int, max_tokens_per_request: int) -> None:
        if max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {max_requests}")
        if max_tokens_per_request < 2:
            raise ValueError(f"max_tokens_per_request must be >= 2, got {max_tokens_per_request}")
        self._max_requests = max_requests
        self._max_tokens = max_tokens_per_request
        self._sources: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # oldest first
        self._next_source_id = 0
        # One int per entry (no tuple): source_id × stride + follower, follower < stride.
        self._stride = max_tokens_per_request
        self._tables: dict[int, dict[int, int]] = {n: {} for n in KEY_LENGTHS}

    @property
    def num_requests(self) -> int:
        return len(self._sources)

    @property
    def num_entries(self) -> int:
        return sum(len(table) for table in self._tables.values())

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self._sources.values())

    def add(self, token_ids: Sequence[int]) -> None:
        if self._max_requests == 0:
            return
        tokens = tuple(token_ids[-self._max_tokens :])
        source_id = self._next_source_id
        self._next_source_id += 1
        self._sources[source_id] = tokens
        for n, follower, key in _followers(tokens):
            self._tables[n][key] = source_id * self._stride + follower
        while len(self._sources) > self._max_requests:
            self._drop_oldest()

    def follower(self, token_ids: Sequence[int], n: int) -> tuple[tuple[int, ...], int] | None:
        """(the source's tokens, where its continuation starts) for the last n tokens, or None."""
        num_tokens = len(token_ids)
        if num_tokens < n:
            return None
        entry = self._tables[n].get(ngram_key(token_ids, num_tokens - n, num_tokens))
        if entry is None:
            return None
        source_id, follower = divmod(entry, self._stride)
        tokens = self._sources[source_id]
        if not same_tokens(tokens[follower - n : follower], token_ids[num_tokens - n :]):
            return None  # a hash collision
        return tokens, follower

    def _drop_oldest(self) -> None:
        source_id, tokens = self._sources.popitem(last=False)
        for n, follower, key in _followers(tokens):
            table = self._tables[n]
            if table.get(key) == source_id * self._stride + follower:
                del table[key]


def _followers(tokens: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """(n, follower, key) for every indexed n-gram of a finished request's tokens."""
    for follower in range(1, len(tokens)):
        for n in KEY_LENGTHS:
            if follower >= n:
                yield n, follower, ngram_key(tokens, follower - n, follower)


class SuffixProposer:
    """The Proposer for method "suffix" (see the module docstring for the algorithm).

    Keeps one index per live request id until `release`; `release(id, token_ids)` moves a finished
    request's tokens into the cross-request index. The ModelRunner is the only caller.
    """

    def __init__(self, max_k: int, max_cached_requests: int, max_tokens_per_cached_request: int = 1024) -> None:
        self._finished = FinishedTokenIndex(max_cached_requests, max_tokens_per_cached_request)
        self._drafter = CopyDrafter(KEY_LENGTHS, min_match=MIN_MATCH, max_k=max_k, lookup=self._lookup)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        return self._drafter.propose(requests)

    def release(self, request_id: str, token_ids: Sequence[int] | None) -> None:
        self._drafter.forget(request_id)
        if token_ids is not None:
            self._finished.add(token_ids)

    @property
    def num_requests(self) -> int:
        """Live requests holding an index (tests: release forgets)."""
        return self._drafter.num_requests

    @property
    def finished(self) -> FinishedTokenIndex:
        return self._finished

    def _lookup(self, own: NgramIndex, token_ids: Sequence[int]) -> CopyCursor | None:
        for n in KEY_LENGTHS:
            position = own.follower(token_ids, n)
            if position is not None:
                return CopyCursor(source=None, position=position, num_tokens=len(token_ids))
            found = self._finished.follower(token_ids, n)
            if found is not None:
                return CopyCursor(source=found[0], position=found[1], num_tokens=len(token_ids))
        return None
