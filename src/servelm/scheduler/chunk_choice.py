"""Which chunk of a prompt a step takes (step 2 of scheduler.py): tokens, or layers of a large chunk.

    budget's chunk = StepPlan.prefill_chunk (the cap and the slots, unpriced steps' whole story)
    in time        = the most of it that keeps the step within its target (step_pricing.py)
    in time == the prompt's rest            → the rest, whole (its first token this step)
    in time too small to run efficiently    → a layered chunk: as many layers of a large chunk as fit
    (its fixed costs > MAX_CHUNK_OVERHEAD of its time, or nothing fits)
    else                                    → the token chunk in time

A prompt that is the step's first prefill work moves by at least a block (or a layer of a chunk of
at least a block) even over the target, so that decodes filling every step never starve the prompts.
"""

from __future__ import annotations

from servelm.scheduler.step_plan import ChunkPlan, StepPlan
from servelm.scheduler.step_pricing import MAX_CHUNK_OVERHEAD


def choose_chunk(plan: StepPlan, rest: int, num_computed: int, mid_prefill: bool, num_layers: int,
                 max_chunk_tokens: int, block_size: int) -> ChunkPlan | None:  # fmt: skip
    """The chunk of a prompt with `rest` tokens left after `num_computed` (None: none this step).
    `mid_prefill`: it ran a chunk before; `num_layers`: the model's layers (0: no layered prefill);
    `max_chunk_tokens`: the largest chunk one forward may take (max_num_batched_tokens)."""
    num_tokens = plan.prefill_chunk(rest, mid_prefill=mid_prefill)
    pricing = plan.pricing
    if pricing is None or not pricing.priced():
        return ChunkPlan(num_tokens) if num_tokens else None
    in_time = pricing.largest_chunk(num_tokens, num_computed)
    if in_time == rest:
        return ChunkPlan(rest)
    if not plan.has_slot(rest):
        return None
    if num_layers and (in_time == 0 or pricing.chunk_overhead_share(in_time, num_computed) > MAX_CHUNK_OVERHEAD):
        # At least a block, as a token chunk's floor: where even one token's layer would overrun
        # the layer budget the target cannot hold anyway, and 1-token chunks only multiply the steps.
        largest = min(rest, max_chunk_tokens)
        chunk = max(pricing.layered_chunk_tokens(largest, num_computed), min(largest, block_size))
        layers = pricing.layers_within(chunk, num_computed, num_layers)
        if layers == 0 and not plan.has_prefill:
            layers = 1
        if 0 < layers < num_layers:
            return ChunkPlan(chunk, layers)
        if layers == num_layers:
            # All of its layers fit after all: an ordinary chunk, so one the token budget bounds
            # (a layered chunk may outgrow what is left of it: it runs in a forward of its own).
            return ChunkPlan(min(chunk, num_tokens))
    if in_time == 0 and not plan.has_prefill:
        in_time = min(num_tokens, block_size)
    return ChunkPlan(in_time) if in_time else None
