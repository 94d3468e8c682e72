"""The sampling path waits for the device once per step, and seeded noise is the seed's own CPU stream.

On a GPU every read of a device value back to the host (`.tolist()`, `.item()`, `bool(t)`,
`.cpu()`) stalls the host until the stream drains. What a CPU run can check of that:

- structurally: SamplingMetadata.build and the Sampler read no tensor value at all (a torch
  function mode sees every such read, whatever the device), and a real engine run calls the one
  device-to-host copy (host_transfer.copy_to_host) exactly once per step that samples, none in a
  step that does not, with greedy, seeded, top-k/top-p, penalty, min_tokens and logprob requests
  and speculative drafts verified in the same steps;
- the packing that makes it one copy gives back exactly the numbers it packed;
- a seeded row's token is argmax(probs / q) with q drawn from a fresh CPU generator of its seed,
  whatever else is in the batch: a function of the seed and the logits only, hence the same on
  CPU and CUDA.

Not checkable here (device-only): that the copies really overlap the stream on CUDA (pinned,
non_blocking), that no kernel on the path synchronises implicitly, and that CPU and CUDA give the
same tokens for the same seed and logits (benchmarks/gpu_devmem_checks.py checks those on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch
from torch.overrides import TorchFunctionMode

import servelm.worker.sampler as sampler_module
from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest, ModelOutput, SchedulerOutput
from servelm.engine.builder import build_engine
from servelm.sampling_params import SamplingParams
from servelm.spec.proposer import DraftRequest
from servelm.structured.masks import GrammarMasks
from servelm.worker.sampler import LogprobsTensors, Sampler
from servelm.worker.sampling_metadata import SamplingMetadata

# Tensor methods that bring a value to the host (on a GPU: a sync each).
VALUE_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


class ValueReads(TorchFunctionMode):
    """Records every tensor method call that reads a value back to Python."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in VALUE_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=0),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.05),
        SamplingParams(temperature=0.7, seed=12, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, presence_penalty=0.5, logprobs=5),
        SamplingParams(temperature=1.0, seed=13, top_k=5, top_p=0.8),
    ]


def test_metadata_and_sampler_read_no_tensor_value() -> None:
    params, vocab = _mixed_params(), 97
    generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(0))
    with ValueReads() as mode:
        metadata = SamplingMetadata.build(
            params, [[1, 2, 3]] * len(params), [[4, 4, 5]] * len(params), generators, vocab, "cpu",
            banned_token_ids=[[7, 8], [], [9], [], [], [7]],
        )  # fmt: skip
        out = Sampler()(logits, metadata)
    assert mode.reads == [], f"the sampling path read tensor values: {mode.reads}"
    assert out.logprobs is not None and out.sampled_token_ids.shape == (len(params),)


def test_packed_logprobs_come_back_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = LogprobsTensors(
        sampled_token_ids=torch.tensor([0, 151_935, 49_151]),
        sampled_logprobs=torch.tensor([-0.0, -1e-8, float("-inf")]),
        sampled_ranks=torch.tensor([1, 151_936, 7]),
        top_token_ids=torch.randint(0, 152_000, (3, 4), generator=gen),
        top_logprobs=-torch.rand(3, 4, generator=gen) * 30,
    )
    back = LogprobsTensors.unpack(tensors.pack())
    for name in ("sampled_token_ids", "sampled_logprobs", "sampled_ranks", "top_token_ids", "top_logprobs"):
        want, got = getattr(tensors, name), getattr(back, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # No logprobs asked: an empty top block still round-trips.
    empty = LogprobsTensors(tensors.sampled_token_ids, tensors.sampled_logprobs, tensors.sampled_ranks,
                            tensors.top_token_ids[:, :0], tensors.top_logprobs[:, :0])  # fmt: skip
    assert LogprobsTensors.unpack(empty.pack()).top_token_ids.shape == (3, 0)


def test_seeded_token_is_a_function_of_the_seed_and_the_logits_only() -> None:
    """Row r with seed s takes argmax(probs[r] / q), q the first (then second, ...) row of Exp(1)
    noise of a fresh CPU generator seeded s: the neighbours, the row it sits in and the logits'
    device play no part (what makes CPU and CUDA agree)."""
    vocab, steps = 300, 4
    sampler = Sampler()
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=4321)
    others = [p for p in _mixed_params() if p.seed is None] + [SamplingParams(temperature=1.0, seed=4321)]
    reference_stream = torch.Generator().manual_seed(4321)
    for row in (0, 2, len(others)):
        batch = list(others)
        batch.insert(row, target)
        generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in batch]
        reference_stream.manual_seed(4321)
        for step in range(steps):
            logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(step))
            metadata = SamplingMetadata.build(batch, [[]] * len(batch), [[]] * len(batch), generators, vocab, "cpu")
            got = int(sampler(logits, metadata).sampled_token_ids[row])
            probs = sampler.probs(logits, metadata)[row]
            noise = torch.empty(vocab).exponential_(generator=reference_stream).clamp_(min=torch.finfo().tiny)
            assert got == int((probs / noise).argmax()), f"row {row}, step {step}"


class RepeatLastToken:
    """A proposer whose drafts are the request's last token repeated, for even request ids only: in
    most steps rows verifying drafts sit next to plain ones, and the drafts are mostly rejected
    (seeded rows then wind their generator back)."""

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        return {r.request_id: [r.token_ids[-1]] * r.max_draft_tokens for r in requests if int(r.request_id) % 2 == 0}

    def release(self, request_id: str, token_ids: Sequence[int] | None) -> None:
        pass


def test_one_host_copy_per_sampling_step_in_a_real_engine(tiny_dir, monkeypatch) -> None:
    # A 48-token budget chunks the longer prompts: steps that sample nothing occur too.
    config = EngineConfig.from_flat(model=str(tiny_dir), num_blocks=96, max_num_batched_tokens=48,
                                    speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                       '"adaptive": false}')  # fmt: skip
    core = build_engine(config, proposer=RepeatLastToken()).core
    copies: list[tuple[int, ...]] = []
    real_copy = sampler_module.copy_to_host

    def counted_copy(tensor: torch.Tensor) -> torch.Tensor:
        copies.append(tuple(tensor.shape))
        return real_copy(tensor)

    monkeypatch.setattr(sampler_module, "copy_to_host", counted_copy)
    steps: list[tuple[int, int, int]] = []  # (copies, rows that sampled, drafts verified) per step
    real_execute = core.runner.execute

    def observed_execute(scheduler_output: SchedulerOutput, grammar_masks: GrammarMasks | None = None) -> ModelOutput:
        before = len(copies)
        output = real_execute(scheduler_output, grammar_masks)
        num_drafts = sum(len(d) for d in scheduler_output.scheduled_draft_token_ids.values())
        sampled = sum(1 for ids in output.sampled_token_ids.values() if ids)
        steps.append((len(copies) - before, sampled, num_drafts))
        return output

    monkeypatch.setattr(core.runner, "execute", observed_execute)
    prompts = [list(range(3, 3 + n)) for n in (4, 30, 70, 110, 9, 17)]
    params = _mixed_params()
    requests = [
        EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=msgspec.structs.replace(
            params[i % len(params)], max_tokens=12, min_tokens=4 if i == 2 else 0))
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip
    core.add_request(requests[3])  # alone first: its first chunks sample nothing
    core.step()
    for request in requests[:3] + requests[4:]:
        core.add_request(request)
    while core.has_work():
        core.step()
    sampling_steps = [s for s in steps if s[1] > 0]
    assert all(num_copies == (1 if sampled else 0) for num_copies, sampled, _ in steps), steps
    assert len(sampling_steps) >= 12 and any(s[1] == 0 for s in steps), "the workload was meant to chunk"
    assert max(s[1] for s in steps) >= 4, "the workload was meant to batch"
    assert any(s[2] > 0 for s in sampling_steps), "the workload was meant to verify drafts"
