"""One key tile of flash attention's running softmax, shared by the decode and prefill kernels.

Scores are kept in log2 units (qk_scale = softmax scale * log2(e), so exp2 replaces exp). For each
query row the running max, the running sum of exp2(score - max) and the unnormalized output acc are
rescaled by exp2(old max - new max) whenever a tile raises the max; the output is acc / sum at the
end. Callers keep every row's first tile non-empty (it holds key 0, or a split's first key), so
the max is finite after it and no row ever computes exp2(-inf - -inf).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q,  # [M, DIM] in the compute dtype
    k,  # [N, DIM] in q's dtype
    v,  # [N, DIM] in q's dtype
    visible,  # [M, N] bool: which keys each row attends to (read only when MASKED)
    row_max,  # [M] float32: running max of the scores, log2 units
    row_sum,  # [M] float32: running sum of exp2(score - row_max)
    acc,  # [M, DIM] float32: running sum of exp2(score - row_max) * v
    qk_scale,  # float: softmax scale * log2(e)
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding), the default otherwise
):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N] float32
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(s, axis=1))
    alpha = tl.exp2(row_max - new_max)  # rescales what was summed under the old max
    p = tl.exp2(s - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, row_sum, acc
