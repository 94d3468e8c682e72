"""The model's RMSNorm (alone and fused with the residual add) and rotary embedding, one set per device.

    ops.rms_norm(x, weight, eps)                -> weight * rmsnorm(x)                        [T, hidden]
    ops.add_rms_norm(x, residual, weight, eps)  -> (weight * rmsnorm(x + residual), x + residual)
    ops.rotate(x, cos, sin)                     -> x: [T, N, D] rotated by cos, sin: [T, 1, D/2];
                                                   it may overwrite x (the caller reads only the result)

TORCH_OPS, the reference (any device): the math below and `rotary.apply_rotary`, bitwise what the
model computed before the fusions existed. `triton_ops()`: one Triton kernel each
(servelm.kernels.triton.norm / .rotary), the same roundings except the order of the sum of
squares; `rotate` works in place. `select_ops(device)` is what the model factory gives a model:
Triton on CUDA when triton imports (and SERVELM_KERNELS is not `torch`), torch everywhere else.
Tests force the Triton set on CPU by assigning `model.norm_rotary_ops = triton_ops()` with
TRITON_INTERPRET=1 in the environment before the kernels are first imported.

Why the residual travels beside the hidden state: a Llama layer is

    h = h + attn(norm1(h));  h = h + mlp(norm2(h))

and carrying `residual` separately lets each add fuse into the norm that reads its result (one
pass over the row instead of an add kernel, then the norm's own passes).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelm import envs
from servelm.models.rotary import apply_rotary

logger = logging.getLogger(__name__)


Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class NormRotaryOps:
    name: str  # "torch" | "triton": in logs and benchmark reports
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rotate: Rotate


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x), normalised in float32 whatever the compute dtype, as the reference does:
    weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype). torch's fused rms_norm is bitwise that in
    float32 (one pass instead of five)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual  # in the dtype, like the unfused `hidden = hidden + out`
    return torch_rms_norm(total, weight, eps), total


TORCH_OPS = NormRotaryOps("torch", torch_rms_norm, torch_add_rms_norm, apply_rotary)


@functools.cache
def triton_ops() -> NormRotaryOps:
    """The Triton set. Raises ImportError where triton does not import. On CPU the kernels run only
    under TRITON_INTERPRET=1, which must be set before this is first called (triton reads it when
    the kernels are defined)."""
    from servelm.kernels.triton import norm, rotary

    return NormRotaryOps("triton", norm.rms_norm, norm.add_rms_norm, rotary.rotate_)


def select_ops(device: torch.device) -> NormRotaryOps:
    """Triton on CUDA where it imports and the kernels are not switched off (SERVELM_KERNELS=torch);
    TORCH_OPS elsewhere (CPU: torch's own kernels are the fast path there, the interpreter is not)."""
    if device.type != "cuda" or envs.kernels_mode() is envs.KernelsMode.TORCH:
        return TORCH_OPS
    try:
        return triton_ops()
    except ImportError as exc:
        logger.warning("triton does not import (%s): RMSNorm and rotary run as torch ops on %s", exc, device)
        return TORCH_OPS
