"""SamplingMetadata: one step's sampling parameters as per-row tensors.

The runner builds it once per step, one row per request that samples a token this
step (a prefill chunk that ends mid-prompt samples nothing and must not have a row:
a seeded request's generator advances once per row it gets).

Tensors that a step does not need are None and the matching flag says why, so a
pure-greedy batch with no penalties builds no tensors at all and the sampler's work
is one argmax.

Building reads no device value: every tensor comes from Python lists, staged through pinned
memory on CUDA (host_transfer.to_device), so it never waits for the forward still running.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.sampling_params import SamplingParams
from servelm.worker.host_transfer import to_device

# Temperatures below this are treated as greedy: dividing logits by them overflows
# or turns sampling into argmax anyway (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool  # no row samples randomly: skip temperature, filters and noise
    all_random: bool  # no row is greedy: skip the greedy argmax
    # [B] bool, True for greedy rows; None when all rows agree (see the two flags).
    greedy_mask: torch.Tensor | None
    # [B] float32; 1.0 on greedy rows so the shared division is harmless. None if all greedy.
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None  # [B] long in [1, V]; V = disabled. None if no random row uses it
    top_p: torch.Tensor | None  # [B] float32 in (0, 1]; 1 = disabled. None if unused
    min_p: torch.Tensor | None  # [B] float32 in [0, 1]; 0 = disabled. None if unused
    repetition_penalty: torch.Tensor | None  # [B] float32; 1 = disabled. None if unused
    frequency_penalty: torch.Tensor | None  # [B] float32; None if no penalty is additive
    presence_penalty: torch.Tensor | None  # [B] float32; None with frequency_penalty
    # Token history padded with `vocab_size` (a column the sampler drops after counting).
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] long; only for repetition
    output_token_ids: torch.Tensor | None  # [B, max_output_len] long; for any penalty
    # Banned (row, token) pairs as two flat index tensors, applied as -inf before anything.
    banned_rows: torch.Tensor | None  # [num_banned] long
    banned_token_ids: torch.Tensor | None  # [num_banned] long
    # Random rows with their own generator; greedy rows never draw noise.
    generators: dict[int, torch.Generator]
    num_logprobs: list[int | None]  # per row, SamplingParams.logprobs
    max_num_logprobs: int | None  # None: no row wants logprobs, skip log_softmax
    # Structured outputs: int32 [B, ceil(V / 32)], bit t % 32 of word t // 32 allowing token t
    # (servelm.structured.masks; all ones on a free row). None when no row is constrained.
    allowed_bitmask: torch.Tensor | None = None

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalty is None and self.frequency_penalty is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        banned_token_ids: list[list[int]] | None = None,
        allowed_bitmask: torch.Tensor | None = None,
    ) -> SamplingMetadata:
        """Lay out `params` (one per row) as tensors on `device`.

        `banned_token_ids[i]` are token ids row i must not produce this step (the
        engine passes EOS/stop ids while a request is under min_tokens). A generator
        must be used only by its own request, and live on the CPU (the runner's do: the
        sampler draws every seeded row on the host, then copies once) or on `device`.
        `allowed_bitmask`: the grammar masks of the step (a host tensor, one row per row).
        """
        num_rows = len(params)
        for name, seq in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("generators", generators),
        ):
            if len(seq) != num_rows:
                raise ValueError(f"{name} has {len(seq)} rows, params has {num_rows}")
        if banned_token_ids is not None and len(banned_token_ids) != num_rows:
            raise ValueError(f"banned_token_ids has {len(banned_token_ids)} rows, params has {num_rows}")

        greedy = [p.temperature < SAMPLING_EPS for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        all_greedy = not random_rows
        all_random = len(random_rows) == num_rows

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        temperature = top_k = top_p = min_p = None
        greedy_mask = None
        if not all_greedy:
            # Greedy rows get neutral values so they never trigger a filter.
            temperature = floats([1.0 if g else p.temperature for p, g in zip(params, greedy)])
            ks = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
            if any(k < vocab_size for k in ks):
                top_k = to_device(ks, torch.long, device)
            ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
            if any(x < 1.0 for x in ps):
                top_p = floats(ps)
            mps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
            if any(x > 0.0 for x in mps):
                min_p = floats(mps)
            if not all_random:
                greedy_mask = to_device(greedy, torch.bool, device)

        # Penalties apply to greedy rows too (they change the argmax).
        repetition_penalty = frequency_penalty = presence_penalty = None
        prompt_ids_t = output_ids_t = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition_penalty = floats([p.repetition_penalty for p in params])
            prompt_ids_t = _pad(prompt_token_ids, vocab_size, device)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency_penalty = floats([p.frequency_penalty for p in params])
            presence_penalty = floats([p.presence_penalty for p in params])
        if repetition_penalty is not None or frequency_penalty is not None:
            output_ids_t = _pad(output_token_ids, vocab_size, device)

        banned_rows = banned_ids = None
        if banned_token_ids is not None and any(banned_token_ids):
            pairs = [(i, t) for i, ids in enumerate(banned_token_ids) for t in ids]
            if any(not 0 <= t < vocab_size for _, t in pairs):
                raise ValueError(f"banned token id out of range [0, {vocab_size})")
            banned_rows = to_device([i for i, _ in pairs], torch.long, device)
            banned_ids = to_device([t for _, t in pairs], torch.long, device)

        num_logprobs = [p.logprobs for p in params]
        requested = [n for n in num_logprobs if n is not None]
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            prompt_token_ids=prompt_ids_t,
            output_token_ids=output_ids_t,
            banned_rows=banned_rows,
            banned_token_ids=banned_ids,
            generators={i: g for i in random_rows if (g := generators[i]) is not None},
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
            allowed_bitmask=allowed_bitmask.to(device, non_blocking=True) if allowed_bitmask is not None else None,
        )


def _pad(rows: list[list[int]], pad_id: int, device: torch.device | str) -> torch.Tensor:
    """[B, max_len] long, right-padded with pad_id (at least one column, so scatter has an index)."""
    width = max(1, max((len(r) for r in rows), default=0))
    padded = [r + [pad_id] * (width - len(r)) for r in rows]
    return to_device(padded, torch.long, device)
