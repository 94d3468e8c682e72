"""The attention backend interface, and the metadata that describes one flattened batch.

A step's batch is the tokens of many requests laid end to end:

    tokens:           | r0 chunk (5) | r1 decode (1) | r2 chunk (3) |
    query_start_loc:  0              5               6              9
    seq_lens:         5              12              7      (cached + new tokens per request)

Request i's new tokens sit at positions [seq_lens[i] - q_len_i, seq_lens[i]) of its
sequence; they attend to every earlier position of the same request and to nothing
of the others. With a paged KV pool the K/V of earlier positions live in blocks:

    slot = block_table[i][pos // block_size] * block_size + pos % block_size

`slot_mapping[t]` is that slot for new token t (where its K/V are written).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # [num_requests + 1], offsets of each request's tokens
    seq_lens: list[int]  # [num_requests], context length after this step (cached + new)
    # Paged KV (all None when the forward runs without a KV pool, e.g. a parity check):
    slot_mapping: torch.Tensor | None = None  # [num_tokens] long, pool slot per new token
    block_tables: list[list[int]] | None = None  # [num_requests][num_blocks], block ids
    block_size: int = 0
    # Index tensors a backend derives from the fields above, built by the first layer
    # and reused by the others (the metadata lives for exactly one step).
    derived: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        starts = self.query_start_loc
        return [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]

    @classmethod
    def for_prompts(cls, prompt_lens: list[int]) -> "AttentionMetadata":
        """Each request is a whole prompt with nothing cached (no KV pool)."""
        starts = [0]
        for n in prompt_lens:
            starts.append(starts[-1] + n)
        return cls(query_start_loc=starts, seq_lens=list(prompt_lens))


class AttentionBackend(Protocol):
    """Computes causal attention for a flattened batch and maintains the paged KV pool.

    Called by the model's attention layers inside the runner's forward, in the engine
    core process. `forward` writes the new tokens' K/V into `kv_cache` at
    `metadata.slot_mapping` (when a cache is given) before reading; it changes nothing
    else, so calling it twice with the same inputs writes the same values twice.
    """

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _BACKENDS[name] = factory


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
