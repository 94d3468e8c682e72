"""NgramProposer (prompt lookup), its NgramIndex, and build_proposer: exact proposals on hand-made lists,
and the incremental index and proposer against brute-force references on random growing lists."""

from __future__ import annotations

import random

import pytest

from servelm.config import SpeculativeConfig
from servelm.spec.ngram import NgramProposer
from servelm.spec.proposer import DraftRequest, build_proposer
from servelm.spec.suffix import SuffixProposer
from servelm.spec.token_match import CONTEXT_AGREEMENT_MAX, MAX_LATER_OCCURRENCES, NgramIndex


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
    # [9, 7, 8] occurred once (followed by 2); its tail [7, 8] occurred earlier, followed by 1.
    token_ids = [7, 8, 1, 9, 7, 8, 2, 5, 9, 7, 8]
    assert propose(NgramProposer(2, 3, max_k=4), token_ids) == [2, 5, 9, 7]
    # Lookup 2..2 sees [7, 8] at both places; the later one's preceding 9 agrees with the list's.
    assert propose(NgramProposer(2, 2, max_k=4), token_ids) == [2, 5, 9, 7]
    assert propose(NgramProposer(2, 2, max_k=4), [7, 8, 1, 9, 7, 8, 2, 5, 6, 7, 8]) == [1, 9, 7, 8]  # a tie


def test_earliest_occurrence_wins_among_equal_contexts() -> None:
    assert propose(NgramProposer(2, 2, max_k=5), [1, 2, 3, 1, 2, 4, 1, 2]) == [3, 1, 2, 4, 1]


def test_the_occurrence_whose_context_agrees_longest_wins() -> None:
    # [1, 2] three times: after 5 (then 3), after 6 6 (then 4), after 7 6 (then 0); the list ends 7 6 1 2.
    token_ids = [5, 1, 2, 3, 6, 6, 1, 2, 4, 7, 6, 1, 2, 0, 8, 7, 6, 1, 2]
    assert propose(NgramProposer(2, 2, max_k=2), token_ids) == [0, 8]


def test_a_loop_is_copied_from_one_period_back_past_the_list_end() -> None:
    # "a_stream_stream_stream" as the default model writes it: the earliest [stream, _, stream] is
    # followed by ":" (9); the loop's own last period agrees for the whole loop and the copy overlaps
    # itself (LZ77-style) for as many drafts as asked.
    stream, underscore, colon = 5, 6, 9
    token_ids = [1, underscore, stream, underscore, stream, colon, 2, 3, underscore]
    token_ids += [stream, underscore] * 5
    assert propose(NgramProposer(3, 3, max_k=6), token_ids) == [stream, underscore] * 3


def test_draft_length_is_capped_by_max_k_and_by_the_request() -> None:
    token_ids = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert propose(NgramProposer(2, 2, max_k=5), token_ids, max_draft_tokens=2) == [3, 4]
    assert propose(NgramProposer(2, 2, max_k=2), token_ids, max_draft_tokens=5) == [3, 4]
    # Past the list's end the copy runs into its own drafts: 1 2 3 4 5 6 7 1 2 | 3 4 5 6 7 1 2 3 4
    assert propose(NgramProposer(2, 2, max_k=9), token_ids) == [3, 4, 5, 6, 7, 1, 2, 3, 4]


def test_the_copy_continues_where_a_fresh_lookup_would_jump_elsewhere() -> None:
    # One run of tokens, longer than the context a lookup compares, twice in the prompt: after 1
    # (then 5 6 0 9) and after 2 (then 5 6 7 8 9). The request copies the second.
    run = list(range(100, 100 + CONTEXT_AGREEMENT_MAX + 8))
    prompt = [1, *run, 5, 6, 0, 9, 2, *run, 5, 6, 7, 8, 9]
    proposer = NgramProposer(1, 1, max_k=2)
    token_ids = [*prompt, 2, run[0]]
    assert propose(proposer, token_ids) == run[1:3]  # the second copy: its 2 agrees
    token_ids += [*run[1:], 5, 6]  # the drafts accepted, and more of the run
    assert propose(proposer, token_ids) == [7, 8]  # the copy goes on
    # A fresh lookup of [6]: both places agree for more than CONTEXT_AGREEMENT_MAX: the earliest.
    assert propose(NgramProposer(1, 1, max_k=2), token_ids) == [0, 9]
    token_ids += [7, 42]  # the copy breaks: a fresh lookup of [42] finds nothing
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
    assert propose(proposer, [9, 8, 9, 8]) == [9, 8, 9]  # the loop 9 8 goes on
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


def best_follower(token_ids: list[int], n: int) -> int | None:
    """The O(context) definition: of the f < len with token_ids[f-n:f] == the last n tokens (the
    earliest and the MAX_LATER_OCCURRENCES latest of them), the one whose preceding tokens agree
    with the list's for the most positions (up to CONTEXT_AGREEMENT_MAX), the earliest on a tie."""
    if len(token_ids) <= n:
        return None
    suffix = token_ids[len(token_ids) - n :]
    matches = [f for f in range(n, len(token_ids)) if token_ids[f - n : f] == suffix]
    if not matches:
        return None

    def agreement(f: int) -> int:
        before, ours = token_ids[: f - n][::-1], token_ids[: len(token_ids) - n][::-1]
        return next((i for i, (a, b) in enumerate(zip(before, ours)) if a != b), len(before))

    candidates = [matches[0], *matches[1:][-MAX_LATER_OCCURRENCES:]]
    return max(candidates, key=lambda f: (min(agreement(f), CONTEXT_AGREEMENT_MAX), -f))


def overlapping_copy(token_ids: list[int], position: int, num_tokens: int) -> list[int]:
    """token_ids[position:] extended by copying itself, num_tokens long (the LZ77 definition)."""
    extended = list(token_ids)
    while len(extended) < position + num_tokens:
        extended.append(extended[len(extended) - (len(token_ids) - position)])
    return extended[position : position + num_tokens]


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
                expected = best_follower(token_ids, n)
                assert index.follower(token_ids, n) == fresh.follower(token_ids, n) == expected


class ReferenceNgram:
    """NgramProposer's rules by brute force: continue the copy, else the best longest match."""

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
                position = best_follower(token_ids, n)
        self.copy = None if position is None else (position, len(token_ids))
        if position is None:
            return []
        return overlapping_copy(token_ids, position, min(self.max_k, max_draft_tokens))


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
