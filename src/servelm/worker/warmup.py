"""Start-up warm-up: a short prefill and one decode step through the runner, before any request.

What a runner's first steps pay once (the compiled CPU kernels' first calls, the allocator growing
its pools, on CUDA Triton's JIT compile of each kernel variant and the cuBLAS handles) would
otherwise land in the first user request's TTFT. The warm-up runs the two kinds of forward a
request needs, a prompt (prefill path) then one token after cached context (decode path):

    step 1  new request, prompt of n tokens in blocks 0..k-1   → prefill + sample
    step 2  1 token at position n                               → decode + sample
    step 3  the request preempted, 0 tokens                     → the runner forgets it

Then `calibrate` times a few prompts of different lengths and a decode after each the same way,
for the scheduler's step-cost model (scheduler/step_cost.py): without it the model has no fit
until four real steps of different sizes ran, and the first long prompt next to a decoding
stream took the static budget, a 2,047-token chunk (1.8 s on the default model, 2 CPU cores)
that an 83-token prompt arriving meanwhile waited 2.5 s for.

Neither passes the scheduler: the SchedulerOutputs are built here and address the first blocks
of the pool directly (at start-up every block is free and holds nothing). Afterwards nothing of
it remains: the runner's mirror and block table row are gone (the row zeroed, as `remove` does
for any request), the blocks it wrote are zeroed again (as allocated; a multi-rank worker's other
ranks keep finite K/V there, which no read reaches before a request writes them), the proposer
was detached for the duration (never asked to propose or release: its indexes and a draft model's
KV are untouched), and the scheduler, the KV manager and their counters never saw it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from servelm.datatypes import CachedRequestData, ModelOutput, NewRequestData, SchedulerOutput
from servelm.sampling_params import SamplingParams
from servelm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "servelm-warmup"
WARMUP_PROMPT_TOKENS = 8  # short: the point is the first call of each path, not a benchmark
# Prompt lengths `calibrate` times: far enough apart for a slope, short enough to cost a start-up
# little (~0.2 s on the default model on 2 CPU cores; on a GPU a few ms).
CALIBRATION_PROMPT_TOKENS = (16, 64, 160)


@dataclass(frozen=True)
class TimedStep:
    """One calibration step as the step-cost model observes a step."""

    num_tokens: int  # tokens scheduled
    num_computed: int  # tokens of the request already computed before it (0: a fresh prompt)
    is_prompt: bool  # a prompt chunk (its attention pairs count), else a decode
    seconds: float  # the runner's own timing (ModelOutput.execute_seconds)


def warm_up(runner: ModelRunner, num_prompt_tokens: int = WARMUP_PROMPT_TOKENS) -> int:
    """Run the warm-up steps (module doc) on a runner that has executed nothing yet; returns the
    tokens computed (prompt + 1), or 0 when the pool or the context has no room for two tokens.
    Called once, by the engine builder, in the engine core process."""
    num_prompt = min(num_prompt_tokens, _capacity(runner) - 1)  # the decode token needs a slot too
    if num_prompt < 1:
        logger.info("warm-up skipped: the KV pool holds %d tokens", _capacity(runner))
        return 0
    _prefill_then_decode(runner, num_prompt)
    return num_prompt + 1


def calibrate(runner: ModelRunner, prompt_sizes: tuple[int, ...] = CALIBRATION_PROMPT_TOKENS) -> list[TimedStep]:
    """After warm_up: each prompt size as a fresh prompt, then one decode after it, timed (module
    doc). Sizes the pool or the context cannot hold are left out."""
    steps: list[TimedStep] = []
    for num_prompt in prompt_sizes:
        if num_prompt + 1 > _capacity(runner):
            continue
        prefill, decode = _prefill_then_decode(runner, num_prompt)
        steps.append(TimedStep(num_prompt, 0, True, prefill.execute_seconds))
        steps.append(TimedStep(1, num_prompt, False, decode.execute_seconds))
    return steps


def _capacity(runner: ModelRunner) -> int:
    """Tokens one request may hold in the pool at start-up."""
    num_pool_blocks = runner.kv_block_tensors[0].shape[1]
    return min(num_pool_blocks, runner.block_table.max_blocks_per_request) * runner.block_size


def _prefill_then_decode(runner: ModelRunner, num_prompt: int) -> tuple[ModelOutput, ModelOutput]:
    """Steps 1-3 of the module doc for a prompt of `num_prompt` tokens; the runner and the pool
    left as they were."""
    block_ids = list(range(-(-(num_prompt + 1) // runner.block_size)))
    prompt = [i % runner.vocab_size for i in range(num_prompt)]
    # No drafts wanted (num_speculative_tokens=0) and no proposer attached: speculation is not warmed.
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, num_speculative_tokens=0)
    rid = WARMUP_REQUEST_ID
    proposer, runner.proposer = runner.proposer, None
    try:
        new = NewRequestData(rid, prompt, [], params, block_ids, num_computed_tokens=0)
        prefill = runner.execute(SchedulerOutput([new], [], {rid: num_prompt}, num_prompt))
        sampled = prefill.sampled_token_ids[rid]
        decode = runner.execute(SchedulerOutput([], [CachedRequestData(rid, sampled, [], num_prompt)], {rid: 1}, 1))
        runner.execute(SchedulerOutput([], [], {}, 0, preempted_request_ids={rid}))
    finally:
        runner.proposer = proposer
    for tensor in runner.kv_block_tensors:  # [2, num_blocks, ...]: the written blocks back to zeros
        tensor[:, : len(block_ids)].zero_()
    return prefill, decode
