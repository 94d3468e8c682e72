"""SuffixProposer and its finished-request index: own and cross-request matches, which match wins,
the minimum match, the caps, release; random lists for the index's eviction and the drafts' soundness."""

from __future__ import annotations

import random

import pytest

from servelm.spec.proposer import DraftRequest
from servelm.spec.suffix import KEY_LENGTHS, MIN_MATCH, FinishedTokenIndex, SuffixProposer


def propose(
    proposer: SuffixProposer, token_ids: list[int], max_draft_tokens: int = 16, request_id: str = "r"
) -> list[int]:
    return proposer.propose([DraftRequest(request_id, token_ids, 0, max_draft_tokens)]).get(request_id, [])


def test_key_lengths_are_longest_first_down_to_the_minimum_match() -> None:
    assert list(KEY_LENGTHS) == sorted(KEY_LENGTHS, reverse=True) and MIN_MATCH == KEY_LENGTHS[-1] == 3


def test_own_tokens_repeat_of_at_least_the_minimum_match() -> None:
    proposer = SuffixProposer(max_k=4, max_cached_requests=8)
    assert propose(proposer, [1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5, 6, 1]
    assert propose(proposer, [1, 2, 7, 8, 1, 2], request_id="short") == []  # a 2-token match is not trusted


def test_finished_requests_tokens_are_proposed_from() -> None:
    proposer = SuffixProposer(max_k=5, max_cached_requests=8)
    proposer.release("a", [50, 10, 11, 12, 13, 14, 15, 16])
    assert proposer.num_requests == 0 and proposer.finished.num_requests == 1
    assert propose(proposer, [99, 10, 11, 12]) == [13, 14, 15, 16]  # up to the end of a's tokens


def test_the_longer_match_wins_wherever_it_is_and_own_wins_ties() -> None:
    proposer = SuffixProposer(max_k=3, max_cached_requests=8)
    proposer.release("finished", [1, 2, 3, 4, 5, 6, 70, 71, 72])
    # own: [4, 5, 6] earlier, followed by 80; finished: [1..6] (a 6-token match), followed by 70
    assert propose(proposer, [4, 5, 6, 80, 1, 2, 3, 4, 5, 6], request_id="longer") == [70, 71, 72]
    # both match only [4, 5, 6]: own wins
    assert propose(proposer, [4, 5, 6, 80, 9, 4, 5, 6], request_id="tie") == [80, 9, 4]


def test_the_most_recent_finished_request_wins() -> None:
    proposer = SuffixProposer(max_k=2, max_cached_requests=8)
    proposer.release("old", [1, 2, 3, 40, 41])
    proposer.release("new", [1, 2, 3, 50, 51])
    assert propose(proposer, [9, 1, 2, 3]) == [50, 51]


def test_the_copy_continues_into_the_same_finished_request() -> None:
    proposer = SuffixProposer(max_k=2, max_cached_requests=8)
    proposer.release("a", [1, 2, 3, 4, 5, 6, 7])
    token_ids = [9, 1, 2, 3]
    assert propose(proposer, token_ids) == [4, 5]
    token_ids += [4, 5, 6]  # both accepted, then the target's 6
    assert propose(proposer, token_ids) == [7]
    token_ids += [7]
    assert propose(proposer, token_ids) == []  # a's tokens end there; nothing else matches


def test_draft_length_is_capped_by_max_k_and_by_the_request() -> None:
    token_ids = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert propose(SuffixProposer(max_k=5, max_cached_requests=0), token_ids, max_draft_tokens=2) == [4, 5]
    assert propose(SuffixProposer(max_k=2, max_cached_requests=0), token_ids, max_draft_tokens=5) == [4, 5]


def test_release_without_tokens_caches_nothing_and_forgets_the_request() -> None:
    proposer = SuffixProposer(max_k=2, max_cached_requests=8)
    assert propose(proposer, [1, 2, 3, 4, 1, 2, 3]) == [4, 1]
    proposer.release("r", None)
    proposer.release("r", None)
    assert proposer.num_requests == 0 and proposer.finished.num_requests == 0
    assert propose(proposer, [5, 6]) == []  # the same id, fresh: no "shrank" error


def test_caps_on_requests_and_tokens_per_request() -> None:
    proposer = SuffixProposer(max_k=2, max_cached_requests=2, max_tokens_per_cached_request=6)
    proposer.release("a", [1, 2, 3, 4, 5])
    proposer.release("b", [20, 21, 22, 23, 24, 25, 26, 27, 28, 29])  # keeps [24..29]
    assert propose(proposer, [0, 20, 21, 22], request_id="b-head") == []  # b's head was not kept
    assert propose(proposer, [0, 24, 25, 26], request_id="b-tail") == [27, 28]
    assert propose(proposer, [0, 1, 2, 3], request_id="a1") == [4, 5]
    proposer.release("c", [7, 8, 9, 10])  # a is the oldest: dropped
    assert proposer.finished.num_requests == 2 and proposer.finished.num_tokens == 6 + 4
    assert propose(proposer, [0, 1, 2, 3], request_id="a2") == []
    assert propose(proposer, [0, 7, 8, 9], request_id="c") == [10]


def test_no_cached_requests_means_own_tokens_only() -> None:
    proposer = SuffixProposer(max_k=2, max_cached_requests=0)
    proposer.release("a", [1, 2, 3, 4])
    assert proposer.finished.num_requests == 0 and proposer.finished.num_entries == 0
    assert propose(proposer, [0, 1, 2, 3]) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_k": 0, "max_cached_requests": 1}, "max_k must be >= 1"),
        ({"max_k": 1, "max_cached_requests": -1}, "max_requests must be >= 0"),
        (
            {"max_k": 1, "max_cached_requests": 1, "max_tokens_per_cached_request": 1},
            "max_tokens_per_request must be >= 2",
        ),
    ],
)
def test_bad_construction_is_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SuffixProposer(**kwargs)


# --- random lists ------------------------------------------------------------------------------------------


def test_after_evictions_the_index_equals_one_built_from_the_kept_requests_alone() -> None:
    rng = random.Random(7)
    max_requests, max_tokens = 3, 40
    index = FinishedTokenIndex(max_requests, max_tokens)
    added: list[list[int]] = []
    for _ in range(12):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 60))]
        index.add(tokens)
        added.append(tokens)
        kept = FinishedTokenIndex(max_requests, max_tokens)
        for earlier in added[-max_requests:]:
            kept.add(earlier)
        assert index.num_requests == kept.num_requests <= max_requests
        assert index.num_entries == kept.num_entries <= max_requests * max_tokens * len(KEY_LENGTHS)
        assert index.num_tokens == kept.num_tokens <= max_requests * max_tokens
        for probe in added[-max_requests:]:
            for end in range(1, len(probe) + 1):
                for n in KEY_LENGTHS:
                    assert index.follower(probe[:end], n) == kept.follower(probe[:end], n)


def test_every_draft_continues_a_real_occurrence_of_the_context() -> None:
    """Soundness on random traffic: a draft is always source[p:p+len] for a source holding, just
    before p, at least MIN_MATCH of the request's latest tokens (or the tokens appended since)."""
    rng = random.Random(11)
    proposer = SuffixProposer(max_k=4, max_cached_requests=3, max_tokens_per_cached_request=30)
    sources: list[list[int]] = []  # every finished request's tokens (a superset of the cached ones)
    for request_number in range(40):
        request_id = f"r{request_number}"
        token_ids = [rng.randrange(3) for _ in range(rng.randint(1, 20))]
        for _ in range(rng.randint(1, 25)):
            draft = propose(proposer, token_ids, rng.randint(1, 6), request_id)
            if draft:
                # From its own tokens a copy may overlap itself (a loop): the draft continues the list.
                candidates = [(token_ids + draft, len(token_ids)), *((s, len(s)) for s in sources)]
                assert any(
                    source[p : p + len(draft)] == draft and source[p - MIN_MATCH : p] == token_ids[-MIN_MATCH:]
                    for source, end in candidates
                    for p in range(MIN_MATCH, end)
                ), (token_ids, draft)
            token_ids += [*draft[: rng.randint(0, len(draft))], rng.randrange(3)]
        finished = rng.random() < 0.8  # else preempted or aborted: nothing cached
        proposer.release(request_id, token_ids if finished else None)
        if finished:
            sources.append(token_ids[-30:])
        assert proposer.num_requests == 0
        assert proposer.finished.num_tokens <= 3 * 30
