"""What the token proposers (ngram.py, suffix.py) share: an n-gram index, a copy cursor, and the
per-request loop over both (`CopyDrafter`); each proposer brings only its lookup.

`NgramIndex`, over one growing token list: each position f >= 1 is the *follower* of the n-grams
that end just before it.

    token_ids:   t0  t1  t2  t3  t4  t5        (length 6; the last token has no follower yet)
    n = 2:      [t0  t1] → f=2   [t1  t2] → f=3   ...   [t3  t4] → f=5
    lookup of the last 2 tokens [t4 t5] → the f of an earlier [t4 t5], if any; propose token_ids[f:]

Only n-grams that already have a follower are indexed, so the list's own last n tokens never match
themselves. `extend` indexes the positions appended since the previous call: O(new tokens × lengths),
never O(context). Keys are Python's `hash()` of the token tuple (ints hash the same in every process,
and an index lives in one); lookups re-check the tokens, so a hash collision is a miss, never a
wrong proposal.

`CopyCursor`: where the previous proposal was copied from. Code-edit output is long runs copied from
the context; once a run is found, the next proposal continues it from the same place (the cursor
moves by the tokens appended since) for as long as those tokens equal the source's, instead of
looking the suffix up again, which can land on another occurrence of a common n-gram.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # proposer.py imports the proposers (its registry): a type-only import breaks the cycle
    from servelm.spec.proposer import DraftRequest


def ngram_key(token_ids: Sequence[int], start: int, stop: int) -> int:
    """The index key of token_ids[start:stop]; equal token runs get equal keys wherever they sit."""
    return hash(tuple(token_ids[start:stop]))


def same_tokens(left: Sequence[int], right: Sequence[int]) -> bool:
    """Element-wise equality across sequence types (a tuple never == a list in Python)."""
    return len(left) == len(right) and all(a == b for a, b in zip(left, right, strict=True))


class NgramIndex:
    """For each n in `lengths`: n-gram → the follower positions of its occurrences, and the lookup
    that picks the occurrence whose preceding context agrees longest with the list's own.

    Which occurrence: the one whose tokens before the n-gram match the tokens before the list's
    last n for the most positions (up to CONTEXT_AGREEMENT_MAX), the earliest on a tie (measured
    against vLLM's earliest in ngram.py). The earliest alone fails on the model's loops: in "a_stream_stream_stream" the earliest
    "stream _ stream" is followed by ":" where the loop goes on, and it is looked up again after
    every rejection; the occurrence one period back agrees for the whole loop. On clean copies the
    right place in the source agrees for many tokens and a repeated phrase elsewhere for few.

    Bounded: the earliest occurrence and the MAX_LATER_OCCURRENCES most recent ones are kept, so a
    lookup compares at most 1 + MAX_LATER_OCCURRENCES candidates over at most
    CONTEXT_AGREEMENT_MAX tokens each.

    Contract: the owner calls `extend(token_ids)` with the same list, only ever longer, before each
    `follower` lookup; a list that shrank is a caller bug (ValueError). Not thread-safe.
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"n-gram lengths must be >= 1, got {list(lengths)}")
        # key → follower of the earliest occurrence; keys seen again also have later followers,
        # oldest first, in `_later` (most n-grams occur once: no list for them).
        self._earliest: dict[int, dict[int, int]] = {n: {} for n in sorted(set(lengths))}
        self._later: dict[int, dict[int, list[int]]] = {n: {} for n in self._earliest}
        self._num_tokens = 0  # length of the list at the last extend()

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index every n-gram whose follower arrived since the previous call."""
        num_tokens = len(token_ids)
        if num_tokens < self._num_tokens:
            raise ValueError(f"token_ids shrank from {self._num_tokens} to {num_tokens} tokens without a release")
        # Followers f = previous length .. new length - 1 (position 0 follows nothing).
        for follower in range(max(self._num_tokens, 1), num_tokens):
            for n, earliest in self._earliest.items():
                if follower < n:
                    continue
                key = ngram_key(token_ids, follower - n, follower)
                if earliest.setdefault(key, follower) != follower:
                    later = self._later[n].setdefault(key, [])
                    later.append(follower)
                    if len(later) > MAX_LATER_OCCURRENCES:
                        del later[0]
        self._num_tokens = num_tokens

    def follower(self, token_ids: Sequence[int], n: int) -> int | None:
        """Where the continuation of an earlier occurrence of the last n tokens starts: the
        occurrence whose preceding tokens agree longest with the list's (see the class doc)."""
        num_tokens = len(token_ids)
        if num_tokens <= n:  # an earlier occurrence needs at least n + 1 tokens
            return None
        key = ngram_key(token_ids, num_tokens - n, num_tokens)
        earliest = self._earliest[n].get(key)
        if earliest is None or not same_tokens(token_ids[earliest - n : earliest], token_ids[num_tokens - n :]):
            return None  # absent, or a hash collision (every occurrence of a key has the same tokens)
        best, best_agreement = earliest, _agreement(token_ids, earliest - n, num_tokens - n)
        for follower in self._later[n].get(key, ()):
            agreement = _agreement(token_ids, follower - n, num_tokens - n)
            if agreement > best_agreement:
                best, best_agreement = follower, agreement
        return best


# An occurrence's preceding context is compared for at most this many tokens: enough to tell the
# place a copy is at from a phrase repeated elsewhere in a file.
CONTEXT_AGREEMENT_MAX = 32
# Later occurrences of one n-gram kept besides the earliest (a loop or a common phrase repeats).
MAX_LATER_OCCURRENCES = 15


def _agreement(token_ids: Sequence[int], start: int, other_start: int) -> int:
    """How many tokens just before `start` equal those just before `other_start` (start < other_start)."""
    length = 0
    while length < min(start, CONTEXT_AGREEMENT_MAX) and token_ids[start - 1 - length] == token_ids[other_start - 1 - length]:
        length += 1
    return length


@dataclass(frozen=True)
class CopyCursor:
    """The previous proposal: copied from `source[position:]` when the request had `num_tokens`."""

    source: Sequence[int] | None  # None: the request's own token_ids; else another request's tokens
    position: int
    num_tokens: int

    def advance(self, token_ids: Sequence[int], min_match: int) -> CopyCursor | None:
        """The cursor moved past the tokens appended since, or None when the copy broke.

        The copy holds when the tokens appended since (at least `min_match` of the latest tokens)
        equal the source's tokens just before the new position, and the source has a next token.
        Nothing appended since: the same cursor (a repeated call repeats the proposal).
        """
        source = token_ids if self.source is None else self.source
        num_appended = len(token_ids) - self.num_tokens
        position = self.position + num_appended
        num_checked = max(min_match, num_appended)
        if num_appended < 0 or position >= len(source) or position < num_checked:
            return None
        if not same_tokens(source[position - num_checked : position], token_ids[len(token_ids) - num_checked :]):
            return None
        return CopyCursor(source=self.source, position=position, num_tokens=len(token_ids))

    def draft(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to max_tokens tokens copied from the source at the cursor (>= 1: the source has one there).

        From the request's own tokens the copy may run into the tokens it is drafting, as LZ77's
        overlapping copies do: a loop with period p copied from p tokens back drafts max_tokens
        tokens of the loop, not just the p tokens before the end.
        """
        if self.source is not None:
            return list(self.source[self.position : self.position + max_tokens])
        draft = list(token_ids[self.position : self.position + max_tokens])
        period = len(token_ids) - self.position
        while len(draft) < max_tokens:
            draft.append(draft[len(draft) - period])
        return draft


# Finds a fresh copy source for a request: (its own index, its token_ids) → a cursor, or None.
Lookup = Callable[[NgramIndex, Sequence[int]], "CopyCursor | None"]


@dataclass
class _RequestState:
    index: NgramIndex
    cursor: CopyCursor | None = None


class CopyDrafter:
    """The propose loop both token proposers share: per request, extend its index, continue the
    previous copy while it holds, else `lookup` a new one; draft up to min(max_k, max_draft_tokens).

    Keeps one NgramIndex (over `lengths`) and cursor per request id until `forget`.
    """

    def __init__(self, lengths: Sequence[int], min_match: int, max_k: int, lookup: Lookup) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self._lengths = lengths
        self._min_match = min_match
        self._max_k = max_k
        self._lookup = lookup
        self._states: dict[str, _RequestState] = {}

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for request in requests:
            draft = self._propose_one(request)
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _propose_one(self, request: DraftRequest) -> list[int]:
        token_ids = request.token_ids
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _RequestState(NgramIndex(self._lengths))
        state.index.extend(token_ids)
        cursor = state.cursor.advance(token_ids, self._min_match) if state.cursor is not None else None
        if cursor is None:
            cursor = self._lookup(state.index, token_ids)
        state.cursor = cursor
        return cursor.draft(token_ids, min(self._max_k, request.max_draft_tokens)) if cursor is not None else []
