"""The flattened inputs of a forward over paged K/V: every new token's position and pool slot, and the
attention inputs the backends build their metadata from. Shared by the runner's steps, its layered
chunks and a draft model's forwards."""

from __future__ import annotations

import torch

from servelm.attention.backend import CommonAttentionInputs, slots_of


def token_positions(num_computed: torch.Tensor, query_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of every new token and the batch index of its request, both [T] long.

    num_computed, query_lens: [R] long. Request i's tokens are positions
    num_computed[i] .. num_computed[i] + query_lens[i] - 1, laid end to end.
    """
    request_of_token = torch.repeat_interleave(torch.arange(query_lens.numel()), query_lens)  # [T]
    first_row = torch.cumsum(query_lens, 0) - query_lens  # [R] row of each request's first token
    offset_in_request = torch.arange(request_of_token.numel()) - first_row[request_of_token]
    return num_computed[request_of_token] + offset_in_request, request_of_token


def paged_attention_inputs(
    table: torch.Tensor,  # [num_rows, max_blocks] int32, CPU: a BlockTable's tensor
    rows: torch.Tensor,  # [R] long: each request's row in `table`
    num_computed: torch.Tensor,  # [R] long: positions already in the KV pool
    query_lens: torch.Tensor,  # [R] long: new tokens this forward
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,  # what the KV pool stores (the model's dtype, or int8 / fp8 codes)
) -> tuple[torch.Tensor, CommonAttentionInputs]:
    """Positions ([T] long, CPU) and attention inputs of a forward over paged K/V whose request i
    runs query_lens[i] new tokens after num_computed[i] (the runner's steps, a draft model's)."""
    seq_lens = num_computed + query_lens  # [R]
    positions, request_of_token = token_positions(num_computed, query_lens)  # [T] each
    slot_mapping = slots_of(table, rows[request_of_token], positions, block_size)  # [T] long
    max_blocks = (int(seq_lens.max()) + block_size - 1) // block_size  # the columns any request reaches
    common = CommonAttentionInputs.from_lens(
        query_lens,
        seq_lens,
        slot_mapping=slot_mapping.to(device, non_blocking=True),
        block_table=table[rows, :max_blocks],  # [R, max_blocks] int32, CPU
        block_size=block_size,
        device=device,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    return positions, common
