"""Batched greedy decoding straight on the model over a paged KV pool: every prompt prefilled in one
flattened forward, then one decode step per token for all of them together.

No scheduler, no block pool: request i's j-th block is `j * R + i` (requests interleaved, so a
wrong block table reads another request's K/V). Every rank of a tensor-parallel group runs the same
calls (the pool holds the rank's own KV heads) and gets the same full logits: the reference a
sharded model is checked against is this same function on one rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from servelm.attention.backend import CommonAttentionInputs
from servelm.models.llama import LlamaForCausalLM
from servelm.models.sharding import local_num_kv_heads
from servelm.worker.kv_cache import allocate_kv_caches
from servelm.worker.model_runner import attention_backend_of


@dataclass
class BatchDecode:
    logits: list[torch.Tensor]  # per step: [R, vocab] float32, each request's last token's logits
    tokens: list[list[int]]  # per request: the greedy tokens, one per step
    step_seconds: list[float]  # per step: wall time of the forward, the logits and the argmax


@torch.inference_mode()
def batch_greedy_decode(
    model: LlamaForCausalLM, prompts: list[list[int]], num_steps: int, block_size: int = 4
) -> BatchDecode:
    """`num_steps` greedy tokens for every prompt (the first from the prefill forward)."""
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    num_requests = len(prompts)
    blocks_per_request = -(-max(len(p) + num_steps for p in prompts) // block_size)
    kv_caches = allocate_kv_caches(
        model.arch, num_requests * blocks_per_request, block_size, dtype, device, local_num_kv_heads(model.arch, model.shard.tp)
    )
    # [R, blocks per request]: block j of request i is j * R + i.
    block_index = torch.arange(blocks_per_request, dtype=torch.int32).unsqueeze(0)
    block_table = block_index * num_requests + torch.arange(num_requests, dtype=torch.int32).unsqueeze(1)
    backend = attention_backend_of(model)
    sequences = [list(p) for p in prompts]
    computed = [0] * num_requests  # tokens of each request whose K/V are in the pool
    result = BatchDecode([], [[] for _ in prompts], [])
    for _ in range(num_steps):
        started = time.perf_counter()
        ids = [t for seq, done in zip(sequences, computed, strict=True) for t in seq[done:]]
        positions = [p for seq, done in zip(sequences, computed, strict=True) for p in range(done, len(seq))]
        request_of = [
            i for i, (seq, done) in enumerate(zip(sequences, computed, strict=True)) for _ in range(len(seq) - done)
        ]
        pos = torch.tensor(positions, device=device)
        rows = torch.tensor(request_of)
        slots = block_table[rows, pos.cpu() // block_size].long() * block_size + pos.cpu() % block_size
        common = CommonAttentionInputs.from_lens(
            [len(seq) - done for seq, done in zip(sequences, computed, strict=True)],
            [len(seq) for seq in sequences],
            slot_mapping=slots.to(device),
            block_table=block_table,
            block_size=block_size,
            device=device,
            dtype=dtype,
        )
        hidden = model(torch.tensor(ids, device=device), pos, backend.build_metadata(common), kv_caches)
        last_rows = (common.query_start_loc[1:] - 1).long().to(device)
        logits = model.compute_logits(hidden[last_rows])  # [R, vocab]
        next_tokens = logits.argmax(dim=-1).tolist()
        result.step_seconds.append(time.perf_counter() - started)
        result.logits.append(logits.cpu())
        for i, token in enumerate(next_tokens):
            computed[i] = len(sequences[i])
            sequences[i].append(token)
            result.tokens[i].append(token)
    return result
