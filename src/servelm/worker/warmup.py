"""Start-up warm-up: a short prefill and one decode step through the runner, before any request.

What a runner's first steps pay once (the compiled CPU kernels' first calls, the allocator growing
its pools, on CUDA Triton's JIT compile of each kernel variant and the cuBLAS handles) would
otherwise land in the first user request's TTFT. The warm-up runs the two kinds of forward a
request needs, a prompt (prefill path) then one token after cached context (decode path):

    step 1  new request, prompt of n tokens in blocks 0..k-1   → prefill + sample
    step 2  1 token at position n                               → decode + sample
    step 3  the request preempted, 0 tokens                     → the runner forgets it

It never passes the scheduler: the SchedulerOutputs are built here and address the first blocks
of the pool directly (at start-up every block is free and holds nothing). Afterwards nothing of
it remains: the runner's mirror and block table row are gone (the row zeroed, as `remove` does
for any request), the blocks it wrote are zeroed again (as allocated; a multi-rank worker's other
ranks keep finite K/V there, which no read reaches before a request writes them), the proposer
was detached for the duration (never asked to propose or release: its indexes and a draft model's
KV are untouched), and the scheduler, the KV manager and their counters never saw it.
"""

from __future__ import annotations

import logging

from servelm.datatypes import CachedRequestData, NewRequestData, SchedulerOutput
from servelm.sampling_params import SamplingParams
from servelm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "servelm-warmup"
WARMUP_PROMPT_TOKENS = 8  # short: the point is the first call of each path, not a benchmark


def warm_up(runner: ModelRunner, num_prompt_tokens: int = WARMUP_PROMPT_TOKENS) -> int:
    """Run the warm-up steps (module doc) on a runner that has executed nothing yet; returns the
    tokens computed (prompt + 1), or 0 when the pool or the context has no room for two tokens.
    Called once, by the engine builder, in the engine core process."""
    block_size = runner.block_size
    num_pool_blocks = runner.kv_block_tensors[0].shape[1]
    capacity = min(num_pool_blocks, runner.block_table.max_blocks_per_request) * block_size  # tokens
    num_prompt = min(num_prompt_tokens, capacity - 1)  # the decode token needs a slot too
    if num_prompt < 1:
        logger.info("warm-up skipped: the KV pool holds %d tokens", capacity)
        return 0
    block_ids = list(range(-(-(num_prompt + 1) // block_size)))
    prompt = [i % runner.vocab_size for i in range(num_prompt)]
    # No drafts wanted (num_speculative_tokens=0) and no proposer attached: speculation is not warmed.
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, num_speculative_tokens=0)
    rid = WARMUP_REQUEST_ID
    proposer, runner.proposer = runner.proposer, None
    try:
        new = NewRequestData(rid, prompt, [], params, block_ids, num_computed_tokens=0)
        prefill = runner.execute(SchedulerOutput([new], [], {rid: num_prompt}, num_prompt))
        sampled = prefill.sampled_token_ids[rid]
        runner.execute(SchedulerOutput([], [CachedRequestData(rid, sampled, [], num_prompt)], {rid: 1}, 1))
        runner.execute(SchedulerOutput([], [], {}, 0, preempted_request_ids={rid}))
    finally:
        runner.proposer = proposer
    for tensor in runner.kv_block_tensors:  # [2, num_blocks, ...]: the written blocks back to zeros
        tensor[:, : len(block_ids)].zero_()
    return num_prompt + 1
