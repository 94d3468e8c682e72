"""Start-up warm-up: a short prefill and one decode step through the runner, before any request.

What a runner's first steps pay once (the compiled CPU kernels' first calls, the allocator growing
its pools, on CUDA Triton's JIT compile of each kernel variant and the cuBLAS handles) would
otherwise land in the first user request's TTFT. The warm-up runs the two kinds of forward a
request needs, a prompt (prefill path) then one token after cached context (decode path):

    step 1  new request, prompt of n tokens in blocks 0..k-1   → prefill + sample
    step 2  1 token at position n                               → decode + sample
    step 3  the request preempted, 0 tokens                     → the runner forgets it

once for a short prompt (few-row matmuls) and once for a longer one (the many-row GEMM).

Then `calibrate` times, the same way, the shapes of step the scheduler's cost model prices
(scheduler/step_cost.py), so that it is right on this machine from the first request: prompts
of a few lengths from the start (tokens, the pass over the weights), a decode after each and a
decode batch of several rows, decodes deep in a context and chunks after cached context of a few
depths (attention pairs, re-reading a context). The deep ones cost seconds on a CPU in full: they
run as a layer slice (the first CALIBRATION_LAYER_SHARE of the model's layers, as layered
prefill runs them; worker/layered_chunks.py) over a context that is whatever the pool's blocks
hold: the time does not depend on the values. Without a calibration the model had no fit until
four real steps of different sizes ran, and the first long prompt next to a decoding stream took
the static budget, a 2,047-token chunk (1.8 s on the default model, 2 CPU cores) that an 83-token
prompt arriving meanwhile waited 2.5 s for; with prompts alone the model priced a 16-token chunk
after 6,144 tokens at a quarter of its time.

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from servelm.datatypes import CachedRequestData, LayerSlice, ModelOutput, NewRequestData, SchedulerOutput
from servelm.sampling_params import SamplingParams
from servelm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "servelm-warmup"
WARMUP_PROMPT_TOKENS = 8  # short: the point is the first call of each path, not a benchmark
# ... and a prompt over MAX_BLOCK_ROWS rows (models/linear_methods.py), whose matmuls take the
# many-row GEMM: its first call lays every weight out for oneDNN (~0.8 s on the default model, 2 CPU
# cores), which the calibration's first prompt would otherwise be timed with.
WARMUP_MANY_ROWS_TOKENS = 32
# Prompt lengths `calibrate` times from the start: far enough apart for a slope, short enough to
# cost a start-up little (~1 s with the repeats on the default model on 2 CPU cores; on a GPU a few ms).
CALIBRATION_PROMPT_TOKENS = (16, 32, 64, 128, 192)
# Times each calibration prompt runs (the fastest is kept).
CALIBRATION_REPEATS = 2
# Decode rows of the calibration's decode batch (each after a prompt of the shortest length).
CALIBRATION_DECODE_ROWS = 4
# (chunk tokens, context) of the chunks timed after cached context, and the contexts of the decodes
# timed deep in one: far enough apart to tell a chunk's pairs from its re-read of the context.
CALIBRATION_DEEP_CHUNKS = ((128, 1024), (256, 2048), (32, 4096))
CALIBRATION_DEEP_DECODES = (1024, 4096)
# Share of the model's layers a deep chunk runs (at least one layer).
CALIBRATION_LAYER_SHARE = 0.1


@dataclass(frozen=True)
class TimedStep:
    """One calibration step as the step-cost model observes a step."""

    num_tokens: int  # tokens scheduled per request
    num_computed: int  # tokens of each request already computed before it (0: a fresh prompt)
    is_prompt: bool  # a prompt chunk (its attention pairs count), else decodes
    seconds: float  # the runner's own timing (ModelOutput.execute_seconds)
    num_requests: int = 1  # rows of a decode batch (prompts: 1)
    layer_share: float = 1.0  # share of the model's layers it ran (a layer slice), 1: all


def warm_up(runner: ModelRunner) -> None:
    """Run the warm-up steps (module doc) on a runner that has executed nothing yet, for a short
    prompt then a many-row one, as far as the pool and the context have room. Called once, by the
    engine builder, in the engine core process."""
    for num_prompt_tokens in (WARMUP_PROMPT_TOKENS, WARMUP_MANY_ROWS_TOKENS):
        num_prompt = min(num_prompt_tokens, _capacity(runner) - 1)  # the decode token needs a slot too
        if num_prompt < 1:
            logger.info("warm-up skipped: the KV pool holds %d tokens", _capacity(runner))
            return
        _prefill_then_decode(runner, num_prompt)


def calibrate(runner: ModelRunner) -> list[TimedStep]:
    """After warm_up: the steps of the module doc, timed. Shapes the pool or the context cannot
    hold are left out (a test's small pool keeps the short prompts and decodes)."""
    steps: list[TimedStep] = []
    capacity = _capacity(runner)
    for num_prompt in CALIBRATION_PROMPT_TOKENS:
        if num_prompt + 1 > capacity:
            continue
        # Twice, the faster kept: these set the fixed part of a step, and with it the default
        # step-time target; one timing on a shared VM varied it 2x between two starts.
        timed = [_prefill_then_decode(runner, num_prompt) for _ in range(CALIBRATION_REPEATS)]
        steps.append(TimedStep(num_prompt, 0, True, min(prefill.execute_seconds for prefill, _ in timed)))
        steps.append(TimedStep(1, num_prompt, False, min(decode.execute_seconds for _, decode in timed)))
    rows = min(CALIBRATION_DECODE_ROWS, len(runner.block_table.num_blocks))  # the table's rows: max_num_seqs
    num_prompt = CALIBRATION_PROMPT_TOKENS[0]
    if rows > 1 and rows * (num_prompt + runner.block_size) + 1 <= min(capacity, _pool_tokens(runner)):
        # Twice as well, the faster kept: with the one-row decodes this step alone splits a step's
        # fixed part from a decode row's price, and the first multi-row decode can pay a one-off cost
        # (a 4-row step timed once at 24 ms beside 7 ms for one row put the fixed part at 1.3 ms
        # instead of ~5, and the default step-time target at 43 ms instead of ~95; 2 AMD cores).
        seconds = min(_decode_batch(runner, rows, num_prompt) for _ in range(CALIBRATION_REPEATS))
        steps.append(TimedStep(1, num_prompt, False, seconds, num_requests=rows))
    for context in CALIBRATION_DEEP_DECODES:
        if context + 1 <= capacity:
            steps.append(TimedStep(1, context, False, _after_context(runner, 1, context, None)))
    num_layers = len(runner.model.decoder_layers)
    slice_layers = max(1, round(CALIBRATION_LAYER_SHARE * num_layers)) if runner.layered_chunks is not None else 0
    for num_tokens, context in CALIBRATION_DEEP_CHUNKS:
        if context + num_tokens <= capacity:
            seconds = _after_context(runner, num_tokens, context, slice_layers or None)
            share = slice_layers / num_layers if slice_layers else 1.0
            steps.append(TimedStep(num_tokens, context, True, seconds, layer_share=share))
    return steps


def _pool_tokens(runner: ModelRunner) -> int:
    return runner.kv_block_tensors[0].shape[1] * runner.block_size


def _capacity(runner: ModelRunner) -> int:
    """Tokens one request may hold in the pool at start-up."""
    num_pool_blocks = runner.kv_block_tensors[0].shape[1]
    return min(num_pool_blocks, runner.block_table.max_blocks_per_request) * runner.block_size


def _prompt(runner: ModelRunner, num_tokens: int) -> list[int]:
    return [i % runner.vocab_size for i in range(num_tokens)]


def _params() -> SamplingParams:
    # No drafts wanted (num_speculative_tokens=0) and no proposer attached: speculation is not warmed.
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, num_speculative_tokens=0)


def _prefill_then_decode(runner: ModelRunner, num_prompt: int) -> tuple[ModelOutput, ModelOutput]:
    """Steps 1-3 of the module doc for a prompt of `num_prompt` tokens; the runner and the pool
    left as they were."""
    block_ids = list(range(-(-(num_prompt + 1) // runner.block_size)))
    rid = WARMUP_REQUEST_ID
    with _detached_proposer(runner):
        new = NewRequestData(rid, _prompt(runner, num_prompt), [], _params(), block_ids, num_computed_tokens=0)
        prefill = runner.execute(SchedulerOutput([new], [], {rid: num_prompt}, num_prompt))
        sampled = prefill.sampled_token_ids[rid]
        decode = runner.execute(SchedulerOutput([], [CachedRequestData(rid, sampled, [], num_prompt)], {rid: 1}, 1))
        runner.execute(SchedulerOutput([], [], {}, 0, preempted_request_ids={rid}))
    _zero_blocks(runner, len(block_ids))
    return prefill, decode


def _decode_batch(runner: ModelRunner, num_requests: int, num_prompt: int) -> float:
    """`num_requests` prompts of `num_prompt` tokens in one step, then one decode step of them all:
    the decode step's seconds. The runner and the pool left as they were."""
    blocks_each = -(-(num_prompt + 1) // runner.block_size)
    ids = [f"{WARMUP_REQUEST_ID}-{i}" for i in range(num_requests)]
    news = [
        NewRequestData(rid, _prompt(runner, num_prompt), [], _params(),
                       list(range(i * blocks_each, (i + 1) * blocks_each)), num_computed_tokens=0)  # fmt: skip
        for i, rid in enumerate(ids)
    ]
    with _detached_proposer(runner):
        prefill = runner.execute(SchedulerOutput(news, [], dict.fromkeys(ids, num_prompt), num_prompt * num_requests))
        diffs = [CachedRequestData(rid, prefill.sampled_token_ids[rid], [], num_prompt) for rid in ids]
        decode = runner.execute(SchedulerOutput([], diffs, dict.fromkeys(ids, 1), num_requests))
        runner.execute(SchedulerOutput([], [], {}, 0, preempted_request_ids=set(ids)))
    _zero_blocks(runner, blocks_each * num_requests)
    return decode.execute_seconds


def _after_context(runner: ModelRunner, num_tokens: int, context: int, num_layers: int | None) -> float:
    """Seconds of `num_tokens` new tokens after `context` tokens the pool's blocks stand in for (their
    values do not change the time): all layers, or the first `num_layers` as a layer slice."""
    num_blocks = -(-(context + num_tokens) // runner.block_size)
    rid = WARMUP_REQUEST_ID
    new = NewRequestData(rid, _prompt(runner, context + num_tokens), [], _params(), list(range(num_blocks)),
                         num_computed_tokens=context)  # fmt: skip
    if num_layers is None:
        step = SchedulerOutput([new], [], {rid: num_tokens}, num_tokens)
    else:
        step = SchedulerOutput([new], [], {}, 0, layer_slices={rid: LayerSlice(num_tokens, 0, num_layers)})
    with _detached_proposer(runner):
        output = runner.execute(step)
        runner.execute(SchedulerOutput([], [], {}, 0, preempted_request_ids={rid}))
    _zero_blocks(runner, num_blocks)
    return output.execute_seconds


@contextmanager
def _detached_proposer(runner: ModelRunner) -> Iterator[None]:
    proposer, runner.proposer = runner.proposer, None
    try:
        yield
    finally:
        runner.proposer = proposer


def _zero_blocks(runner: ModelRunner, num_blocks: int) -> None:
    for tensor in runner.kv_block_tensors:  # [2, num_blocks, ...]: the written blocks back to zeros
        tensor[:, :num_blocks].zero_()
