"""A proposer that knows the answer: it drafts each request's known continuation, with random mistakes.

For tests of verification, not of proposing: the continuation comes from a run without
speculation (or the single-sequence reference), so a draft position is right unless this
proposer corrupts it; each call corrupts one random position with probability `mistake_rate`
and proposes a random number of tokens, so acceptance lengths cover 0..k at random, and the
scheduler's catch-up, block accounting and the sampler's per-position rows meet every case.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from servelm.spec.proposer import DraftRequest


class ScriptedProposer:
    def __init__(self, continuations: dict[str, list[int]], vocab_size: int, mistake_rate: float, seed: int) -> None:
        self.continuations = continuations  # request_id → prompt + its expected output
        self.vocab_size = vocab_size
        self.mistake_rate = mistake_rate
        self.rng = random.Random(seed)
        self.num_proposed = 0
        self.released: list[str] = []

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for request in requests:
            expected = self.continuations.get(request.request_id)
            num_known = len(request.token_ids)
            if expected is None or list(expected[:num_known]) != list(request.token_ids):
                continue  # off the script (it diverged): no guess
            guess = list(expected[num_known : num_known + self.rng.randint(0, request.max_draft_tokens)])
            if guess and self.rng.random() < self.mistake_rate:
                position = self.rng.randrange(len(guess))
                guess[position] = (guess[position] + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
            if guess:
                drafts[request.request_id] = guess
                self.num_proposed += len(guess)
        return drafts

    def release(self, request_id: str, token_ids: Sequence[int] | None) -> None:
        self.released.append(request_id)
