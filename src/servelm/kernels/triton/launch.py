"""A kernel launch as data: the kernel, its grid and every argument by name.

Each launcher builds one (`*_launch` functions, pure: no kernel runs) and runs it. Kept as data so
the ahead-of-time compile check (tests/attention) can compile the exact argument set a launcher
passes for a GPU target on a machine without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton


@dataclass(frozen=True)
class KernelLaunch:
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: dict[str, Any]  # every kernel parameter by name: tensors, ints, floats and constexprs
    num_warps: int = 4

    def run(self) -> None:
        if 0 in self.grid:
            return  # nothing to compute (no rows of this kind this step)
        self.kernel[self.grid](**self.args, num_warps=self.num_warps)


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor): tile shapes (`tl.arange` takes powers of two)."""
    return max(triton.next_power_of_2(n), floor)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for operands of `dtype`: float32 stays IEEE (Triton's default rounds
    its operands to TF32, ~1e-3 relative, where the torch reference computes in full float32)."""
    return "ieee" if dtype == torch.float32 else "tf32"
