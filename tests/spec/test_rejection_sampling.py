"""Sampling with drafts emits exactly the target's distribution (chi-square, fixed seed).

The runner's verification path at the function level: one sampler row per draft position
(temperature, top-k, top-p applied to the target), then `accept_drafts`. Over many independent
requests on a tiny vocabulary: the first emitted token follows the target's filtered
distribution at position 0 whatever the draft, and the token after an accepted draft follows
position 1's. Significance 0.001 per test; critical values are the chi-square quantiles for
the degrees of freedom used (no scipy here).
"""

from __future__ import annotations

import pytest
import torch

from servelm.sampling_params import SamplingParams
from servelm.worker.sampler import Sampler
from servelm.worker.sampling_metadata import SamplingMetadata
from servelm.worker.spec_verify import accept_drafts

# chi-square 0.999 quantiles by degrees of freedom
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
NUM_REQUESTS = 40_000


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom over the support of probs (every cell expects >= 5)."""
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "a token outside the target's support was emitted"
    total = counts[support].sum()
    expected = probs[support] / probs[support].sum() * total
    assert bool((expected >= 5).all())
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["plain", "top-k", "top-p"],
)
@pytest.mark.parametrize("draft_rank", [0, 3], ids=["likely-draft", "unlikely-draft"])
def test_emitted_tokens_follow_the_target(params: SamplingParams, draft_rank: int) -> None:
    torch.manual_seed(1234)
    vocab = 8
    logits = torch.tensor(
        [[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], [0.1, -1.0, 1.2, 0.4, 2.2, -0.3, 0.0, 1.0]]
    )  # [positions, vocab]: the target at the draft's position and after it
    draft = [int(logits[0].argsort(descending=True)[draft_rank]), 4]
    sampler = Sampler()
    metadata = SamplingMetadata.build(
        params=[params] * (3 * NUM_REQUESTS),
        prompt_token_ids=[[0]] * (3 * NUM_REQUESTS),
        output_token_ids=[[]] * (3 * NUM_REQUESTS),
        generators=[None] * (3 * NUM_REQUESTS),
        vocab_size=vocab,
        device="cpu",
    )
    batch = torch.cat([logits, logits[-1:]]).repeat(NUM_REQUESTS, 1)  # 3 rows per request: drafts + 1
    samples = sampler(batch, metadata).sampled_token_ids.view(NUM_REQUESTS, 3).tolist()
    emitted = [accept_drafts(draft, row) for row in samples]

    target = sampler.probs(logits, SamplingMetadata.build(
        params=[params] * 2, prompt_token_ids=[[0]] * 2, output_token_ids=[[]] * 2, generators=[None] * 2,
        vocab_size=vocab, device="cpu"))  # fmt: skip
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=vocab).float()
    statistic, dof = _chi_square(first, target[0])
    assert statistic < CHI2_CRITICAL_0_001[dof], (statistic, dof)
    after_accept = [e[1] for e in emitted if len(e) > 1]
    assert len(after_accept) == int(first[draft[0]]), "every accepted draft is followed by a token"
    if len(after_accept) > 1000:
        second = torch.bincount(torch.tensor(after_accept), minlength=vocab).float()
        statistic, dof = _chi_square(second, target[1])
        assert statistic < CHI2_CRITICAL_0_001[dof], (statistic, dof)


def test_a_biased_acceptance_rule_is_caught() -> None:
    """The test has power: accepting the draft whenever it is in the top 2 (a plausible bug) fails."""
    torch.manual_seed(7)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    draws = torch.multinomial(probs, NUM_REQUESTS, replacement=True)
    biased = torch.where(draws <= 1, torch.zeros_like(draws), draws)  # draft token 0 accepted too eagerly
    statistic, dof = _chi_square(torch.bincount(biased, minlength=4).float(), probs)
    assert statistic > CHI2_CRITICAL_0_001[dof]
