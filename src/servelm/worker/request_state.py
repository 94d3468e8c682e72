"""The runner's mirror of one request: only what a forward and the sampler need.

Updated from SchedulerOutput alone (new requests in full, running ones as diffs), never
from anything the runner samples itself. That keeps the scheduler the one writer of
request state and lets the runner live in another process later. A request's blocks
live in the runner's `BlockTable` (one row per request), updated in the same place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.datatypes import CachedRequestData, NewRequestData
from servelm.sampling_params import SamplingParams


@dataclass
class RunnerRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int
    # Seeded requests only; on the CPU whatever the device, so a seed's stream is the same
    # everywhere (the sampler draws its noise on the host: worker/sampler.py).
    generator: torch.Generator | None
    lora_name: str | None = None  # its LoRA adapter (None: the base model)

    @classmethod
    def from_new(cls, data: NewRequestData, vocab_size: int) -> RunnerRequestState:
        generator = None
        seed = data.sampling_params.seed
        if seed is not None and not data.sampling_params.is_greedy:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(seed)
            # A request resumed after preemption re-enters with outputs already drawn:
            # advance the stream past them so the next token is the one it would have had.
            for _ in data.output_token_ids:
                advance_generator(generator, vocab_size)
        return cls(
            request_id=data.request_id,
            prompt_token_ids=list(data.prompt_token_ids),
            output_token_ids=list(data.output_token_ids),
            sampling_params=data.sampling_params,
            num_computed_tokens=data.num_computed_tokens,
            generator=generator,
            lora_name=data.lora_name,
        )

    def apply(self, diff: CachedRequestData) -> None:
        self.output_token_ids.extend(diff.new_token_ids)
        self.num_computed_tokens = diff.num_computed_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        """prompt + output, as a new list."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


def advance_generator(generator: torch.Generator, vocab_size: int) -> None:
    """Replay one sampled token's draw: the sampler takes one row of `vocab_size` exponentials
    (float32, on the generator's device)."""
    torch.empty(vocab_size, dtype=torch.float32, device=generator.device).exponential_(generator=generator)
