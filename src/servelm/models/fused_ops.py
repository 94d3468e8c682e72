"""The model's RMSNorm (alone and fused with the residual add) and rotary embedding, one set per device.

    ops.rms_norm(x, weight, eps)                -> weight * rmsnorm(x)                        [T, hidden]
    ops.add_rms_norm(x, residual, weight, eps)  -> (weight * rmsnorm(x + residual), x + residual)
    ops.rotate(x, cos, sin)                     -> x: [T, N, D] rotated by cos, sin: [T, 1, D/2];
                                                   it may overwrite x (the caller reads only the result)
    ops.silu_mul(gate_up)                       -> silu(gate) * up for gate_up [T, 2I] = gate | up: [T, I]

TORCH_OPS, the reference (any device): the math below and `rotary.apply_rotary`, bitwise what the
model computed before the fusions existed. `triton_ops()`: one Triton kernel each
(servelm.kernels.triton.norm / .rotary), the same roundings except the order of the sum of
squares; `rotate` works in place. `cpu_ops()`: the compiled CPU row ops (kernels/csrc/row_ops.c), one
pass per row with the rows over the threads, for float32 (other dtypes take the torch ops): rotary
bitwise torch's, norms and SiLU within float32 rounding of them (their sums and exp differ in order
and last bits); measured on the default model it cut a 3,000-token prefill's norm / rotary / SiLU
time (~330 ms of 3.6 s) several times over. `select_ops(device)` is what the model factory gives
a model: Triton on CUDA when triton imports, the CPU set on CPU when the kernels build (either
unless SERVELM_KERNELS is `torch`), torch otherwise.
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
from servelm.kernels import cpu as cpu_kernels
from servelm.models.rotary import apply_rotary

logger = logging.getLogger(__name__)


Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class NormRotaryOps:
    name: str  # "torch" | "triton": in logs and benchmark reports
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rotate: Rotate
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


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


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


TORCH_OPS = NormRotaryOps("torch", torch_rms_norm, torch_add_rms_norm, apply_rotary, torch_silu_mul)


@functools.cache
def triton_ops() -> NormRotaryOps:
    """The Triton set. Raises ImportError where triton does not import. On CPU the kernels run only
    under TRITON_INTERPRET=1, which must be set before this is first called (triton reads it when
    the kernels are defined)."""
    from servelm.kernels.triton import norm, rotary

    return NormRotaryOps("triton", norm.rms_norm, norm.add_rms_norm, rotary.rotate_, torch_silu_mul)


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors)


@functools.cache
def cpu_ops() -> NormRotaryOps | None:
    """The compiled CPU set, or None where the kernels are off or do not build here."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return None

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (_float32_cpu(x, weight) and x.dim() == 2 and x.is_contiguous()):
            return torch_rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)[0]

    def add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_float32_cpu(x, residual, weight) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous()):
            return torch_add_rms_norm(x, residual, weight, eps)
        return kernels.rms_norm(x, weight, eps, residual)

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        heads_contiguous = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
        if not (_float32_cpu(x, cos, sin) and heads_contiguous and cos.is_contiguous() and sin.is_contiguous()):
            return apply_rotary(x, cos, sin)
        return kernels.rotate_(x, cos, sin)

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if not (_float32_cpu(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous()):
            return torch_silu_mul(gate_up)
        return kernels.silu_mul(gate_up)

    return NormRotaryOps("cpu", rms_norm, add_rms_norm, rotate, silu_mul)


def select_ops(device: torch.device) -> NormRotaryOps:
    """Triton on CUDA where it imports, the compiled row ops on CPU where they build, unless the kernels
    are switched off (SERVELM_KERNELS=torch); TORCH_OPS elsewhere."""
    if envs.kernels_mode() is envs.KernelsMode.TORCH:
        return TORCH_OPS
    if device.type == "cpu":
        return cpu_ops() or TORCH_OPS
    if device.type != "cuda":
        return TORCH_OPS
    try:
        return triton_ops()
    except ImportError as exc:
        logger.warning("triton does not import (%s): RMSNorm and rotary run as torch ops on %s", exc, device)
        return TORCH_OPS
