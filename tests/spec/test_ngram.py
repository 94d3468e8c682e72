"""NgramProposer (prompt lookup), its NgramIndex, and build_proposer: exact proposals on hand-made lists,
and the incremental index and proposer against brute-force references on random growing lists."""

from __future__ import annotations

import random

import pytest

from servelm.config import SpeculativeConfig
from servelm.spec.ngram import NgramProposer
from servelm.spec.proposer import DraftRequest, build_proposer
from servelm.spec.suffix import SuffixProposer
from servelm.spec.token_match import NgramIndex


def propose(
    proposer: NgramProposer, token_ids: list[int], max_draft_tokens: int = 16, request_id: str = "r"
) -> list[int]:
    drafts = proposer.propose([DraftRequest(request_id, token_ids, 1, max_draft_tokens)])
    return drafts.get(request_id, [])


def test_proposes_what_followed_the_last_n_tokens() -> None:
    assert propose(NgramProposer(3, 3, max_k=5), [1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9, 1, 2]


def test_no_earlier_occurrence_no_proposal() -> None:
    proposer = NgramProposer(2, 4, max_k=5)
    assert proposer.propose([DraftRequest("r", [1, 2, 3, 4, 5, 6], 3, 5)]) == {}
    assert propose(proposer, [7], request_id="short") == []  # shorter than any n-gram


def test_lookup_min_is_the_shortest_match_used() -> None:
    token_ids = [1, 2, 7, 8, 9, 1, 2]  # only the 2-gram [1, 2] repeats
    assert propose(NgramProposer(3, 5, max_k=3), token_ids) == []
    assert propose(NgramProposer(2, 5, max_k=3), token_ids) == [7, 8, 9]


def test_longest_match_first_up_to_lookup_max() -> None:
    # [5, 7, 8] occurred once (followed by 2); its tail [7, 8] occurred earlier, followed by 1.
    token_ids = [7, 8, 1, 5, 7, 8, 2, 5, 7, 8]
    assert propose(NgramProposer(2, 3, max_k=4), token_ids) == [2, 5, 7, 8]
    assert propose(NgramProposer(2, 2, max_k=4), token_ids) == [1, 5, 7, 8]


def test_earliest_occurrence_wins() -> None:
    assert propose(NgramProposer(2, 2, max_k=5), [1, 2, 3, 1, 2, 4, 1, 2]) == [3, 1, 2, 4, 1]


def test_draft_length_is_capped_by_max_k_and_by_the_request() -> None:
    token_ids = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert propose(NgramProposer(2, 2, max_k=5), token_ids, max_draft_tokens=2) == [3, 4]
    assert propose(NgramProposer(2, 2, max_k=2), token_ids, max_draft_tokens=5) == [3, 4]
    assert propose(NgramProposer(2, 2, max_k=16), token_ids) == [3, 4, 5, 6, 7, 1, 2]  # the list's end


def test_the_copy_continues_where_a_fresh_lookup_would_jump_elsewhere() -> None:
    prompt = [5, 6, 0, 1, 2, 5, 6, 7, 8]  # [5, 6] at 0 (then 0) and at 5 (then 7)
    proposer = NgramProposer(2, 2, max_k=3)
    token_ids = [*prompt, 1, 2]
    assert propose(proposer, token_ids, max_draft_tokens=1) == [5]  # copying from position 5
    token_ids += [5, 6]  # the draft accepted, then the target's own 6
    assert propose(proposer, token_ids) == [7, 8, 1]  # the copy goes on from position 7
    assert propose(NgramProposer(2, 2, max_k=3), token_ids) == [0, 1, 2]  # vLLM's earliest [5, 6]
    token_ids += [7, 42]  # the copy breaks: a fresh lookup of [7, 42] finds nothing
    assert propose(proposer, token_ids) == []


def test_a_repeated_call_repeats_the_proposal() -> None:
    proposer = NgramProposer(2, 2, max_k=3)
    token_ids = [1, 2, 3, 4, 1, 2]
    assert propose(proposer, token_ids) == propose(proposer, token_ids) == [3, 4, 1]


def test_release_forgets_and_the_id_may_come_back_shorter() -> None:
    proposer = NgramProposer(2, 2, max_k=3)
    assert propose(proposer, [1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    assert proposer.num_requests == 1
    with pytest.raises(ValueError, match="shrank from 6 to 3"):
        propose(proposer, [9, 8, 9])  # same id, fewer tokens, never released
    proposer.release("r", None)  # preempted: its tokens come back (recomputed) under the same id
    assert proposer.num_requests == 0
    assert propose(proposer, [9, 8, 9, 8]) == [9, 8]
    proposer.release("r", [9, 8, 9, 8])
    proposer.release("r", None)  # twice, and unknown ids, are fine
    proposer.release("never-seen", None)
    assert proposer.num_requests == 0


def test_requests_are_independent() -> None:
    proposer = NgramProposer(2, 2, max_k=2)
    drafts = proposer.propose([DraftRequest("a", [1, 2, 3, 1, 2], 2, 4), DraftRequest("b", [4, 5, 6, 1, 2], 2, 4)])
    assert drafts == {"a": [3, 1]}


@pytest.mark.parametrize(
    "args, message",
    [((0, 3, 5), "1 <= lookup_min <= lookup_max"), ((4, 3, 5), "1 <= lookup_min"), ((1, 3, 0), "max_k must be >= 1")],
)
def test_bad_construction_is_named(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NgramProposer(*args)


def test_bad_draft_requests_are_named() -> None:
    with pytest.raises(ValueError, match="request x: max_draft_tokens must be >= 1, got 0"):
        DraftRequest("x", [1, 2], 1, 0)
    with pytest.raises(ValueError, match="request x: num_prompt_tokens 3 is outside 0..2"):
        DraftRequest("x", [1, 2], 3, 1)


def test_build_proposer_by_method() -> None:
    ngram = build_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2))
    assert isinstance(ngram, NgramProposer)
    # prompt_lookup_min=2 alone means lookup 2..2; k = 2
    assert ngram.propose([DraftRequest("r", [1, 2, 3, 4, 5, 1, 2], 2, 8)]) == {"r": [3, 4]}
    assert isinstance(build_proposer(SpeculativeConfig(method="suffix")), SuffixProposer)
    with pytest.raises(ValueError, match="builds ngram, suffix, not 'draft'"):
        build_proposer(SpeculativeConfig(method="draft", draft_num_layers=2))


# --- the incremental structures against brute force, on random lists over a small alphabet ----------------


def earliest_follower(token_ids: list[int], n: int) -> int | None:
    """The O(context) definition: the first f with token_ids[f-n:f] == the last n tokens, f < len."""
    suffix = token_ids[len(token_ids) - n :]
    if len(token_ids) <= n:
        return None
    return next((f for f in range(n, len(token_ids)) if token_ids[f - n : f] == suffix), None)


def test_index_grown_in_chunks_equals_the_brute_force_definition() -> None:
    rng = random.Random(1234)
    for _ in range(40):
        lengths = range(rng.randint(1, 3), rng.randint(4, 6))
        index = NgramIndex(lengths)
        token_ids: list[int] = []
        while len(token_ids) < 120:
            token_ids += [rng.randrange(4) for _ in range(rng.choice([1, 1, 2, 7]))]
            index.extend(token_ids)
            fresh = NgramIndex(lengths)
            fresh.extend(token_ids)
            for n in lengths:
                expected = earliest_follower(token_ids, n)
                assert index.follower(token_ids, n) == fresh.follower(token_ids, n) == expected


class ReferenceNgram:
    """NgramProposer's rules by brute force: continue the copy, else the earliest longest match."""

    def __init__(self, lookup_min: int, lookup_max: int, max_k: int) -> None:
        self.lookup_min, self.lookup_max, self.max_k = lookup_min, lookup_max, max_k
        self.copy: tuple[int, int] | None = None  # (position proposed from, length then)

    def propose(self, token_ids: list[int], max_draft_tokens: int) -> list[int]:
        position = None
        if self.copy is not None:
            appended = len(token_ids) - self.copy[1]
            candidate = self.copy[0] + appended
            checked = max(self.lookup_min, appended)
            if candidate < len(token_ids) and token_ids[candidate - checked : candidate] == token_ids[-checked:]:
                position = candidate
        for n in range(self.lookup_max, self.lookup_min - 1, -1):
            if position is None:
                position = earliest_follower(token_ids, n)
        self.copy = None if position is None else (position, len(token_ids))
        if position is None:
            return []
        return token_ids[position : position + min(self.max_k, max_draft_tokens)]


def test_proposer_on_random_growth_equals_the_reference() -> None:
    rng = random.Random(99)
    for _ in range(30):
        lookup_min = rng.randint(1, 3)
        lookup_max = lookup_min + rng.randint(0, 2)
        max_k = rng.randint(1, 6)
        proposer, reference = (
            NgramProposer(lookup_min, lookup_max, max_k),
            ReferenceNgram(lookup_min, lookup_max, max_k),
        )
        token_ids = [rng.randrange(5) for _ in range(rng.randint(1, 30))]
        draft: list[int] = []
        for _ in range(60):
            max_draft_tokens = rng.randint(1, 8)
            draft = propose(proposer, token_ids, max_draft_tokens)
            assert draft == reference.propose(token_ids, max_draft_tokens)
            if rng.random() < 0.8:  # verified: a prefix of the draft, then one token of the target's own
                token_ids += [*draft[: rng.randint(0, len(draft))], rng.randrange(5)]
            else:  # steps without a proposal call (the draft unused): tokens from elsewhere
                token_ids += [rng.randrange(5) for _ in range(rng.randint(1, 3))]
