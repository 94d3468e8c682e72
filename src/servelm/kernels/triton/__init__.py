"""Triton kernels of the GPU attention path (`servelm.attention.triton_backend` drives them).

- `pool`: how the kernels address one layer's paged KV pool (`KVPool`; the tile loads they share).
- `online_softmax`: one key tile of flash attention's running softmax.
- `kv_write`: new tokens' K/V into the pool at their slots (quantized for an int8 / fp8 pool).
- `decode_attention`: one query token per request over its blocks, optionally split over the
  context (flash-decoding); `split_merge` combines the splits by their log-sum-exp.
- `prefill_attention`: ragged query chunks after cached context, causal within the chunk.
- `launch`: the launch of one kernel as data (grid, arguments), which the launchers run and the
  ahead-of-time compile check (tests) compiles for a GPU target without one.

Importing this package imports triton (an optional dependency: the `gpu` extra). With
TRITON_INTERPRET=1 in the environment before that import, every kernel runs under Triton's
interpreter on CPU tensors (how the tests run them); `interpreter_compat` patches two bugs of
that interpreter first.
"""

from servelm.kernels.triton import interpreter_compat

interpreter_compat.apply_if_interpreting()
