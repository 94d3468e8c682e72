"""Sampler tests: every processing step against a plain per-row reference (numpy, float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from servelm.sampling_params import SamplingParams
from servelm.worker.sampler import Sampler
from servelm.worker.sampling_metadata import SamplingMetadata

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
sampler = Sampler()


def build(
    params: list[SamplingParams],
    vocab: int,
    device: str = "cpu",
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    banned: list[list[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        vocab_size=vocab,
        device=device,
        banned_token_ids=banned,
    )


def seeded(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# --- plain reference -------------------------------------------------------------------


def ref_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_penalised(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int], banned: list[int]):
    x = logits.astype(np.float64).copy()
    for t in banned:
        x[t] = -np.inf
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (1.0 if c > 0 else 0.0)
    return x


def ref_filtered(logits, p: SamplingParams, prompt=(), output=(), banned=()) -> np.ndarray:
    """One random row's tempered logits, -inf outside its support."""
    x = ref_penalised(logits, p, list(prompt), list(output), list(banned)) / p.temperature
    vocab = len(x)
    if p.min_p > 0:
        probs = ref_softmax(x)
        threshold = p.min_p * probs.max()
        x = np.array([v if probs[i] >= threshold else -np.inf for i, v in enumerate(x)])
    if 0 < p.top_k < vocab:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = np.array([v if v >= kth else -np.inf for v in x])
    if p.top_p < 1.0:
        probs = ref_softmax(x)
        keep, mass = [], 0.0
        for i in sorted(range(vocab), key=lambda i: -probs[i]):
            if keep and mass >= p.top_p:
                break
            keep.append(i)
            mass += probs[i]
        x = np.array([v if i in keep else -np.inf for i, v in enumerate(x)])
    return x


def assert_matches_reference(logits: torch.Tensor, params, prompts=None, outputs=None, banned=None) -> None:
    batch, vocab = logits.shape
    md = build(params, vocab, prompts=prompts, outputs=outputs, banned=banned)
    got_logits = sampler.filtered_logits(logits, md).double().numpy()
    got = sampler.probs(logits, md).double().numpy()
    for i, p in enumerate(params):
        want_logits = ref_filtered(
            logits[i].numpy(),
            p,
            prompts[i] if prompts else (),
            outputs[i] if outputs else (),
            banned[i] if banned else (),
        )
        support = np.isfinite(want_logits)
        assert support.any()
        np.testing.assert_array_equal(np.isfinite(got_logits[i]), support, err_msg=f"support of row {i}")
        np.testing.assert_allclose(got_logits[i][support], want_logits[support], rtol=1e-5, err_msg=f"row {i}")
        np.testing.assert_allclose(got[i], ref_softmax(want_logits), atol=1e-6, err_msg=f"row {i}")
    # Sampling never leaves the support: draw each row many times.
    reps = 200
    md_rep = build(
        [p for p in params for _ in range(reps)],
        vocab,
        prompts=[x for x in prompts for _ in range(reps)] if prompts else None,
        outputs=[x for x in outputs for _ in range(reps)] if outputs else None,
        banned=[x for x in banned for _ in range(reps)] if banned else None,
    )
    sampled = sampler(logits.repeat_interleave(reps, dim=0), md_rep).sampled_token_ids.view(batch, reps)
    for i in range(batch):
        assert all(np.isfinite(got_logits[i, t]) for t in sampled[i].tolist()), f"row {i} sampled outside its support"


# --- greedy ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_builds_nothing(device: str) -> None:
    logits = torch.randn(8, 100, generator=seeded(0)).to(device)
    md = build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 8, 100, device)
    assert md.all_greedy and md.temperature is None and md.top_k is None and md.no_penalties
    out = sampler(logits, md)
    assert out.sampled_token_ids.device == logits.device
    assert out.logprobs is None
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_temperature_to_zero_limit() -> None:
    logits = torch.randn(64, 50, generator=seeded(1))
    best = logits.argmax(dim=-1)
    logits[torch.arange(64), best] += 0.1  # a margin: e^(-0.1 / 1e-3) is never drawn
    md = build([SamplingParams(temperature=1e-3)] * 64, 50)
    assert not md.all_greedy
    assert torch.equal(sampler(logits, md).sampled_token_ids, best)
    # The distribution sharpens monotonically towards one-hot on the argmax.
    peaks = [
        sampler.probs(logits, build([SamplingParams(temperature=t)] * 64, 50)).max(dim=-1).values
        for t in (2, 1, 0.3, 0.05)
    ]
    for hotter, colder in zip(peaks, peaks[1:]):
        assert torch.all(colder >= hotter)
    assert torch.all(peaks[-1] > 0.85)
    # Below the epsilon a temperature counts as greedy.
    assert build([SamplingParams(temperature=1e-7)], 50).all_greedy


# --- filters and penalties against the reference ------------------------------------------

FILTER_CASES = {
    "top_k": [SamplingParams(top_k=k) for k in (1, 2, 5, 17, 63, 64, 100, 0)],
    "top_p": [SamplingParams(top_p=p) for p in (0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)],
    "min_p": [SamplingParams(min_p=m) for m in (0.0, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0)],
    "temperature": [SamplingParams(temperature=t) for t in (0.1, 0.5, 0.7, 1.0, 1.3, 2.0, 3.0, 10.0)],
    "combined": [
        SamplingParams(temperature=0.7, top_k=10, top_p=0.9),
        SamplingParams(temperature=1.5, top_k=40, top_p=0.5, min_p=0.02),
        SamplingParams(temperature=0.3, min_p=0.2, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=3, min_p=0.5),
        SamplingParams(temperature=2.0, top_p=0.7),
        SamplingParams(),
    ],
}


@pytest.mark.parametrize("case", list(FILTER_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filters_match_reference(case: str, seed: int) -> None:
    params = FILTER_CASES[case]
    logits = 2.0 * torch.randn(len(params), 64, generator=seeded(seed))
    assert_matches_reference(logits, params)


def _history(seed: int, batch: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, size=rng.integers(0, 12)).tolist() for _ in range(batch)]
    # Outputs repeat tokens so counts > 1 matter for the frequency penalty.
    outputs = [rng.integers(0, vocab // 4, size=rng.integers(0, 20)).tolist() for _ in range(batch)]
    return prompts, outputs


PENALTY_PARAMS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-0.5),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(presence_penalty=-1.0, frequency_penalty=0.3),
    SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5, top_k=20, temperature=0.8),
    SamplingParams(),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_reference(seed: int) -> None:
    batch, vocab = len(PENALTY_PARAMS), 40
    logits = 2.0 * torch.randn(batch, vocab, generator=seeded(seed))
    prompts, outputs = _history(seed, batch, vocab)
    md = build(PENALTY_PARAMS, vocab, prompts=prompts, outputs=outputs)
    penalised = sampler.apply_penalties(logits, md).double().numpy()
    for i, p in enumerate(PENALTY_PARAMS):
        want = ref_penalised(logits[i].numpy(), p, prompts[i], outputs[i], [])
        np.testing.assert_allclose(penalised[i], want, rtol=1e-6, atol=1e-6)
    assert_matches_reference(logits, PENALTY_PARAMS, prompts, outputs)


def test_penalties_change_greedy_choice() -> None:
    """Greedy rows take the argmax of the penalised logits, not the raw ones."""
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[:, 4] = 2.0
    logits[:, 7] = 1.5
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 4 seen → 1.0 < 1.5
        SamplingParams(temperature=0.0, frequency_penalty=0.3),  # 4 twice → 2.0 - 0.6 < 1.5
        SamplingParams(temperature=0.0, presence_penalty=0.3),  # 4 → 1.7 > 1.5: unchanged
    ]
    md = build(params, vocab, prompts=[[4], [], []], outputs=[[], [4, 4], [4, 4]])
    assert sampler(logits, md).sampled_token_ids.tolist() == [7, 7, 4]
    # Repetition penalty is over the prompt too; frequency/presence over the output only.
    md = build(params[1:], vocab, prompts=[[4, 4, 4], [4, 4, 4]], outputs=[[], []])
    assert sampler(logits[1:], md).sampled_token_ids.tolist() == [4, 4]


# --- seeds -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_reproducible_in_any_batch(device: str) -> None:
    vocab, steps = 500, 6
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234)
    target_logits = torch.randn(steps, vocab, generator=seeded(7)).to(device)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=99),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=1.2, min_p=0.1),
        SamplingParams(temperature=1.0, seed=1234),  # same seed, its own generator
        SamplingParams(temperature=0.8, repetition_penalty=1.1),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]

    def run(row: int, with_others: bool) -> list[int]:
        batch_params = list(others) if with_others else []
        batch_params.insert(row, target)
        gens = [seeded(p.seed, device) if p.seed is not None else None for p in batch_params]
        tokens = []
        for step in range(steps):
            logits = torch.randn(len(batch_params), vocab, device=device)
            logits[row] = target_logits[step]
            md = build(batch_params, vocab, device, generators=gens)
            tokens.append(int(sampler(logits, md).sampled_token_ids[row]))
        return tokens

    alone = run(0, with_others=False)
    assert run(0, with_others=True) == alone
    assert run(5, with_others=True) == alone
    assert run(7, with_others=True) == alone
    # A different seed gives different tokens (500-way choices, 6 steps).
    target.seed = 4321
    assert run(0, with_others=False) != alone


def test_generator_advances_once_per_sampled_token_only() -> None:
    gen = seeded(5)
    before = gen.get_state().clone()
    md = build([SamplingParams(temperature=0.0, seed=5)], 20, generators=[gen])
    sampler(torch.randn(1, 20), md)
    assert torch.equal(gen.get_state(), before), "a greedy row must not draw noise"
    md = build([SamplingParams(temperature=1.0, seed=5)], 20, generators=[gen])
    sampler(torch.randn(1, 20), md)
    expected = seeded(5)
    torch.empty(20).exponential_(generator=expected)
    assert torch.equal(gen.get_state(), expected.get_state())


def test_unseeded_rows_differ_across_runs() -> None:
    logits = torch.zeros(32, 1000)
    md = build([SamplingParams(temperature=1.0)] * 32, 1000)
    first = sampler(logits, md).sampled_token_ids
    second = sampler(logits, md).sampled_token_ids
    assert not torch.equal(first, second)
    assert len(set(first.tolist())) > 20  # shared noise is still independent across rows


# --- statistics ------------------------------------------------------------------------


def chi_square(samples: torch.Tensor, expected: np.ndarray) -> float:
    counts = np.bincount(samples.numpy(), minlength=len(expected))
    want = expected * len(samples)
    return float(((counts - want) ** 2 / want).sum())


@pytest.mark.parametrize("use_generators", [False, True])
def test_sampling_matches_distribution(use_generators: bool) -> None:
    p = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 20000 if not use_generators else 4000
    logits = torch.tensor(np.log(p), dtype=torch.float32).repeat(n, 1)
    gens = [seeded(10_000 + i) for i in range(n)] if use_generators else None
    with torch.random.fork_rng():
        torch.manual_seed(0)
        md = build([SamplingParams(temperature=1.0)] * n, 5, generators=gens)
        samples = sampler(logits, md).sampled_token_ids
        # df = 4: the 99.99th percentile is ~23.5.
        assert chi_square(samples, p) < 25.0
        # Temperature 2 and top-k 3: p^(1/2) over the three most likely, renormalised.
        md = build([SamplingParams(temperature=2.0, top_k=3)] * n, 5, generators=gens)
        samples = sampler(logits, md).sampled_token_ids
    q = np.sqrt(p[:3]) / np.sqrt(p[:3]).sum()
    assert samples.max() <= 2
    assert chi_square(samples, np.concatenate([q, [1e-12, 1e-12]])) < 25.0


# --- logprobs --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw(device: str) -> None:
    vocab = 60
    num_logprobs = [None, 0, 1, 5, 20, 3]
    params = [
        SamplingParams(temperature=0.0, logprobs=num_logprobs[0]),
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=3.0),
        SamplingParams(temperature=1.0, logprobs=1, top_k=5),
        SamplingParams(temperature=0.5, logprobs=5, frequency_penalty=2.0),
        SamplingParams(temperature=2.0, logprobs=20, top_p=0.5),
        SamplingParams(temperature=1.0, logprobs=3, min_p=0.3),
    ]
    logits = (3.0 * torch.randn(6, vocab, generator=seeded(3))).to(device=device, dtype=torch.bfloat16)
    prompts, outputs = _history(3, 6, vocab)
    md = build(params, vocab, device, prompts=prompts, outputs=outputs)
    out = sampler(logits, md)
    assert out.logprobs is not None and out.logprobs.top_token_ids.shape == (6, 20)

    raw = logits.float().cpu().double().log_softmax(dim=-1).numpy()
    sampled = out.sampled_token_ids.cpu().tolist()
    rows = out.logprobs.to_position_logprobs(md.num_logprobs)
    assert rows[0] is None
    for i, n in enumerate(num_logprobs):
        if n is None:
            continue
        row = rows[i]
        assert row is not None and len(row.top) == n
        assert row.chosen.token_id == sampled[i]
        assert math.isclose(row.chosen.logprob, raw[i, sampled[i]], abs_tol=1e-5)
        assert row.chosen.rank == 1 + int((raw[i] > raw[i, sampled[i]]).sum())
        want_ids = sorted(range(vocab), key=lambda t: -raw[i, t])[:n]
        assert [t.token_id for t in row.top] == want_ids
        assert [t.rank for t in row.top] == list(range(1, n + 1))
        for t in row.top:
            assert math.isclose(t.logprob, raw[i, t.token_id], abs_tol=1e-5)
        assert all(a.logprob >= b.logprob for a, b in zip(row.top, row.top[1:]))
        # The row helper agrees with the batch conversion.
        assert out.logprobs.row(i, n) == row
    # The penalised greedy row (repetition 3.0) may pick a token that is not rank 1 raw.
    assert rows[1] is not None and rows[1].chosen.rank >= 1


# --- banned ids and mixed batches ------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_banned_ids_never_sampled(device: str) -> None:
    vocab, reps = 30, 300
    logits = torch.randn(reps * 2, vocab, generator=seeded(4))
    logits[:, [3, 9, 11]] = 20.0  # the banned tokens are by far the most likely
    logits = logits.to(device)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * reps
    banned = [[3, 9, 11]] * (2 * reps)
    out = sampler(logits, build(params, vocab, device, banned=banned))
    ids = out.sampled_token_ids.cpu()
    assert not set(ids.tolist()) & {3, 9, 11}
    masked = logits.cpu().clone()
    masked[:, [3, 9, 11]] = float("-inf")
    assert torch.equal(ids[0::2], masked[0::2].argmax(dim=-1))
    # Per-row lists: row 0 bans nothing, so it still takes the raw argmax.
    out = sampler(logits[:2], build(params[:2], vocab, device, banned=[[], [3, 9, 11]]))
    assert int(out.sampled_token_ids[0]) in (3, 9, 11)
    assert int(out.sampled_token_ids[1]) not in (3, 9, 11)


def test_mixed_greedy_and_random_rows() -> None:
    vocab = 40
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, top_k=4, seed=i) for i in range(12)]
    logits = torch.randn(12, vocab, generator=seeded(6))
    gens = [seeded(i) for i in range(12)]
    md = build(params, vocab, generators=gens)
    assert not md.all_greedy and not md.all_random and set(md.generators) == {1, 2, 4, 5, 7, 8, 10, 11}
    ids = sampler(logits, md).sampled_token_ids
    top4 = logits.topk(4, dim=-1).indices
    for i, t in enumerate(ids.tolist()):
        if i % 3 == 0:
            assert t == int(logits[i].argmax())
        else:
            assert t in top4[i].tolist()


def test_rejects_mismatched_inputs() -> None:
    md = build([SamplingParams()] * 2, 10)
    with pytest.raises(ValueError, match="logits shape"):
        sampler(torch.randn(2, 11), md)
    with pytest.raises(ValueError, match="out of range"):
        build([SamplingParams()], 10, banned=[[10]])
    with pytest.raises(ValueError, match="rows"):
        SamplingMetadata.build([SamplingParams()], [[]], [], [None], vocab_size=10, device="cpu")
