"""Single-sequence greedy decoding straight on the model: the reference the engine is checked against.

No scheduler, no block pool: one request, blocks 0..n in order, one prefill then one
token per forward. It is itself checked against transformers (tests/models), so the
engine's exactness tests can use it where running transformers for every prompt
would be slow.
"""

from __future__ import annotations

import torch

from servelm.attention.backend import CommonAttentionInputs
from servelm.models.llama import LlamaForCausalLM
from servelm.worker.kv_cache import allocate_kv_caches
from servelm.worker.model_runner import attention_backend_of


@torch.inference_mode()
def greedy_decode(
    model: LlamaForCausalLM,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
    block_size: int = 16,
) -> list[int]:
    """Greedy tokens after the prompt; stops after a stop token (included) or max_new_tokens."""
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    total = len(prompt_token_ids) + max_new_tokens
    num_blocks = (total + block_size - 1) // block_size
    kv_caches = allocate_kv_caches(model.arch, num_blocks, block_size, dtype, device)
    block_table = torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0)  # [1, num_blocks] identity: slot == position
    backend = attention_backend_of(model)

    tokens = list(prompt_token_ids)
    output: list[int] = []
    start = 0
    while len(output) < max_new_tokens:
        end = len(tokens)
        common = CommonAttentionInputs.from_lens(
            [end - start],
            [end],
            slot_mapping=torch.arange(start, end, device=device),
            block_table=block_table,
            block_size=block_size,
            device=device,
            dtype=dtype,
        )
        metadata = backend.build_metadata(common)
        ids = torch.tensor(tokens[start:end], device=device)
        hidden = model(ids, torch.arange(start, end, device=device), metadata, kv_caches)
        next_token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        output.append(next_token)
        tokens.append(next_token)
        start = end
        if next_token in stop_token_ids:
            break
    return output


@torch.inference_mode()
def prompt_logits(model: LlamaForCausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len, vocab] for every position of each prompt, all in one flattened forward."""
    device = model.embed_tokens.weight.device
    flat = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.tensor([i for p in prompts for i in range(len(p))], device=device)
    common = CommonAttentionInputs.for_prompts([len(p) for p in prompts], device)
    logits = model.compute_logits(model(flat, positions, attention_backend_of(model).build_metadata(common)))
    starts = common.query_start_loc.tolist()
    return [logits[starts[i] : starts[i + 1]] for i in range(len(prompts))]
