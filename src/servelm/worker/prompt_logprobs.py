"""Prompt logprobs: how likely the model found each prompt token given the ones before it.

A prefill chunk covering positions [s, e) yields logits at each position p that score
token p + 1. Over all chunks of a prompt of length L the entries come out in order:

    chunk [0, e1)   → None (position 0 has no context), tokens 1 .. e1
    chunk [e1, e2)  → tokens e1 + 1 .. e2
    ...             → up to token L - 1; the last prompt position scores the first output

so concatenating each chunk's list gives exactly L entries. Requests that ask for
prompt logprobs bypass the prefix cache (cached positions produce no logits).
"""

from __future__ import annotations

import torch

from servelm.datatypes import PositionLogprobs
from servelm.models.llama import LlamaForCausalLM
from servelm.worker.host_transfer import to_device
from servelm.worker.sampler import token_logprobs


def chunk_prompt_logprobs(
    model: LlamaForCausalLM,
    chunk_hidden: torch.Tensor,  # [e - s, hidden]
    prompt_token_ids: list[int],
    chunk_start: int,
    num_top: int,
) -> list[PositionLogprobs | None]:
    prompt_len = len(prompt_token_ids)
    chunk_end = chunk_start + chunk_hidden.shape[0]
    entries: list[PositionLogprobs | None] = [None] if chunk_start == 0 else []
    # Positions p in [s, min(e, L - 1)) score prompt token p + 1.
    last_scoring = min(chunk_end, prompt_len - 1)
    if last_scoring <= chunk_start:
        return entries
    logits = model.compute_logits(chunk_hidden[: last_scoring - chunk_start])
    targets = to_device(prompt_token_ids[chunk_start + 1 : last_scoring + 1], torch.long, logits.device)
    return entries + token_logprobs(logits, targets, num_top)
