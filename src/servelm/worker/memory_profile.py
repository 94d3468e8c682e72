"""What a step costs in device memory, measured once at start-up to size the KV pool on CUDA.

    weights loaded ──▶ empty_cache, reset the peak ──▶ one worst-case step ──▶ DeviceMemoryProfile
                       (allocated now = the weights)     (below)                 (kv_cache.kv_blocks_for_device
                                                                                   turns it into blocks)

The worst-case step: max_num_batched_tokens tokens of prompts (each at most max_model_len) through
the model without a KV pool, then logits and the sampler, with every filter, penalty and 20
logprobs, over the most rows a step samples (max_num_seqs, times 1 + k verified drafts). Not
covered: a chunk's attention over a long cached context (the KV-less forward attends within the
chunk only), and a draft model's own forwards; the reserve in kv_cache.py is the margin for them.

`profile_device_memory` is CUDA only and has never run: it was written on a machine without a
GPU (benchmarks/gpu_devmem_checks.py is its first run). `worst_case_step` runs on any device (the
tests run it on CPU).
"""

from __future__ import annotations

import torch

from servelm.attention.backend import CommonAttentionInputs
from servelm.models.llama import LlamaForCausalLM
from servelm.sampling_params import SamplingParams
from servelm.worker.kv_cache import DeviceMemoryProfile
from servelm.worker.model_runner import attention_backend_of
from servelm.worker.sampler import Sampler
from servelm.worker.sampling_metadata import SamplingMetadata

# The most expensive sampling settings: the top-k/top-p sort, min_p's softmax, penalty counts, logprobs.
WORST_CASE_SAMPLING = SamplingParams(
    temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1, frequency_penalty=0.1, logprobs=20
)


def profile_device_memory(
    model: LlamaForCausalLM, max_num_batched_tokens: int, max_model_len: int, max_sample_rows: int
) -> DeviceMemoryProfile:
    """Run the worst-case step on the model's CUDA device and measure (module doc). Called once by
    the engine builder, before the KV pool exists; leaves nothing allocated behind."""
    device = model.embed_tokens.weight.device
    if device.type != "cuda":
        raise ValueError(f"device memory is profiled on CUDA only, the model is on {device}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    worst_case_step(model, max_num_batched_tokens, max_model_len, max_sample_rows)
    torch.cuda.synchronize(device)
    peak_activation = torch.cuda.max_memory_allocated(device) - weights
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    return DeviceMemoryProfile(int(total), int(weights), int(peak_activation), max(int(non_torch), 0),
                               max_num_batched_tokens)  # fmt: skip


@torch.inference_mode()
def worst_case_step(model: LlamaForCausalLM, num_tokens: int, max_model_len: int, num_rows: int) -> None:
    """`num_tokens` tokens of prompts (max_model_len each, the rest in one) through the model without
    a KV pool, then logits and the sampler over min(num_rows, num_tokens) rows (module doc). Runs
    on any device (the tests run it on CPU); what it leaves is garbage."""
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    num_full, rest = divmod(num_tokens, max_model_len)
    prompt_lens = [max_model_len] * num_full + ([rest] if rest else [])
    common = CommonAttentionInputs.from_lens(prompt_lens, prompt_lens, slot_mapping=None, block_table=None,
                                             block_size=0, device=device, dtype=dtype)  # fmt: skip
    backend = attention_backend_of(model)
    positions = torch.cat([torch.arange(n) for n in prompt_lens]).to(device)  # [T]
    hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device), positions, backend.build_metadata(common))
    num_rows = min(num_rows, num_tokens)
    rows = torch.arange(num_rows, device=device)  # which rows does not matter, only how many
    logits = model.compute_logits(hidden[rows])  # [S, V] float32
    metadata = SamplingMetadata.build(
        [WORST_CASE_SAMPLING] * num_rows, [[0]] * num_rows, [[0]] * num_rows, [None] * num_rows,
        model.arch.vocab_size, device,
    )  # fmt: skip
    Sampler()(logits, metadata)
