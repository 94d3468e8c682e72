"""Checks on the tensors handed to a compiled kernel, run before any pointer reaches C.

A C kernel trusts its pointers and sizes: a float64 tensor read as float32, a transposed
view read as if contiguous, or a size that disagrees with another argument's makes it read
memory that is not the tensor's. Each check names the argument and what was expected and
found. They cost a few attribute reads each (they run on every layer of every step).
"""

from __future__ import annotations

import torch


class KernelArgumentError(ValueError):
    """An argument does not fit a compiled kernel's contract; nothing was read or written."""


def check_tensor(name: str, value: object, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """`value` as a contiguous CPU tensor of `dtype` with `ndim` dimensions, else KernelArgumentError."""
    # One short-circuit expression on the hot path (every layer, every step); the detail only on failure.
    if (
        isinstance(value, torch.Tensor)
        and value.dtype == dtype
        and value.is_cpu
        and value.dim() == ndim
        and value.is_contiguous()
    ):
        return value
    raise KernelArgumentError(f"{name}: {_what_is_wrong(value, dtype, ndim)}")


def _what_is_wrong(value: object, dtype: torch.dtype, ndim: int) -> str:
    if not isinstance(value, torch.Tensor):
        return f"expected a torch.Tensor, found {type(value).__name__}"
    if value.dtype != dtype:
        return f"expected dtype {dtype}, found {value.dtype}"
    if not value.is_cpu:
        return f"expected a CPU tensor, found one on {value.device}"
    if value.dim() != ndim:
        return f"expected {ndim} dimensions, found shape {tuple(value.shape)}"
    return f"expected a contiguous tensor, found shape {tuple(value.shape)} with strides {value.stride()}"


def check_shape(name: str, value: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    """KernelArgumentError unless value.shape == expected; `meaning` says what the dimensions are."""
    if value.shape != expected:
        raise KernelArgumentError(f"{name}: expected shape {expected} ({meaning}), found {tuple(value.shape)}")


def check_int(name: str, value: object, minimum: int) -> int:
    """`value` as a Python int >= minimum (bools refused), else KernelArgumentError."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise KernelArgumentError(f"{name}: expected an int, found {type(value).__name__}")
    if value < minimum:
        raise KernelArgumentError(f"{name}: expected at least {minimum}, found {value}")
    return value
