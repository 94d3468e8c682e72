"""Two bugs of Triton 3.6's interpreter (TRITON_INTERPRET=1: the kernels run with NumPy on CPU
tensors, how the tests run them), patched until a release fixes them. Nothing here touches
compiled kernels: `apply_if_interpreting` does nothing unless the interpreter is on.

- A loop bound loaded from memory (`range(start, seq_len, TILE)`, the kernels' device-side loop
  bounds) is a one-element array to the interpreter, and NumPy >= 2.4 refuses `int()` of one
  (triton-lang/triton#9171; fixed upstream by #9172, after 3.6).
- `tl.dot` of bfloat16 operands multiplies their raw uint16 bits (the interpreter stores bfloat16
  as uint16; triton-lang/triton#11584). They are converted to float32 first: what a GPU's bf16
  MMA computes too (products exact in float32, float32 accumulation).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton
import triton.language as tl
from triton.runtime import interpreter

_applied = False


def apply_if_interpreting() -> None:
    """Patch the interpreter when it is on (knobs read TRITON_INTERPRET); idempotent."""
    global _applied
    if _applied or not triton.knobs.runtime.interpret:
        return
    _applied = True
    _patch_loop_bounds()
    _patch_bf16_dot()


def _patch_loop_bounds() -> None:
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        # .item(): a scalar is a one-element array here, which int() no longer takes.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


def _patch_bf16_dot() -> None:
    builder_class = interpreter.InterpreterBuilder
    create_dot = builder_class.create_dot

    def as_float32(handle: Any) -> Any:
        if handle.dtype != tl.bfloat16:
            return handle
        values = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(values, tl.float32)

    def patched(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        return create_dot(self, as_float32(a), as_float32(b), d, input_precision, max_num_imprecise_acc)

    builder_class.create_dot = patched
