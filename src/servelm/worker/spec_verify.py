"""Verifying draft tokens: the target samples every draft position, the drafts it agrees with are kept.

A request verifying drafts d_1..d_k runs its last token and the drafts in one forward (k + 1
positions). Position j's logits are the target's distribution for the token after d_1..d_j.
The ordinary sampler draws one token y_j at every position, each row with the history it would
have had (`VerificationRows`: penalties, min_tokens and the seed's stream see d_1..d_j as
output), and the emitted tokens are y_0, y_1, ... up to and including the first y_j != d_{j+1}
(all k + 1 when every draft matched):

- greedy: y_j is the argmax, so the output is token for token what decoding without drafts gives;
- sampling: this is rejection sampling with a point-mass proposal (a proposer's guess is a
  deterministic function of the context): d_{j+1} is accepted with probability p_j(d_{j+1}), and a
  rejection emits y_j drawn from p_j conditioned on y_j != d_{j+1} — together exactly p_j. A seeded
  request's generator is wound back to after the draws the emitted tokens used, so a seed gives
  the same tokens with speculation as without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servelm.worker.request_state import RunnerRequestState, advance_generator


def accept_drafts(drafts: Sequence[int], samples: Sequence[int]) -> list[int]:
    """Emitted tokens: `samples` (the target's token at each of the len(drafts) + 1 positions) up to
    and including the first that disagrees with the draft at its position."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"{len(samples)} samples for {len(drafts)} drafts: want one per position, drafts + 1")
    emitted: list[int] = []
    for position, token in enumerate(samples):
        emitted.append(token)
        if position == len(drafts) or token != drafts[position]:
            break
    return emitted


@dataclass
class VerificationRows:
    """The sampler rows of one request this step: one per verified position (1 without drafts)."""

    state: RunnerRequestState
    drafts: list[int]
    generator_state: torch.Tensor | None  # the seeded generator before this step's draws

    @classmethod
    def of(cls, state: RunnerRequestState, drafts: list[int]) -> VerificationRows:
        seeded = state.generator is not None and bool(drafts)
        return cls(state, drafts, state.generator.get_state() if seeded and state.generator is not None else None)

    @property
    def num_rows(self) -> int:
        return len(self.drafts) + 1

    def output_histories(self) -> list[list[int]]:
        """Row j's output so far: the request's output, then the drafts before position j."""
        output = self.state.output_token_ids
        return [output] + [output + self.drafts[:j] for j in range(1, self.num_rows)]

    def rewind(self, num_emitted: int, vocab_size: int) -> None:
        """Leave a seeded generator as if only the emitted tokens had been drawn (one draw each)."""
        generator = self.state.generator
        if self.generator_state is None or generator is None or num_emitted == self.num_rows:
            return
        generator.set_state(self.generator_state)
        for _ in range(num_emitted):
            advance_generator(generator, vocab_size)
