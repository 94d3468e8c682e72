"""Rotary position embeddings (Hugging Face's rotate-half layout), with Llama-3, linear and YaRN scaling."""

from __future__ import annotations

import math

import torch

from servelm.models.arch import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as the checkpoint asks."""
    # On the CPU even under a `torch.device("meta")` context (the model is built there): the meta
    # device runs these ops through torch._refs, whose first use imports torch._dynamo (~2 s of start-up).
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling)
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: the frequencies that rotate fewer than
    beta_slow times over the original context are interpolated (divided by `factor`), those that
    rotate more than beta_fast times kept, a linear ramp over the dimensions between."""

    def dimension_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(scaling.beta_fast), dimension_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as the reference: no division by zero
    interpolated = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    return (inv_freq / scaling.factor) * interpolated + inv_freq * (1 - interpolated)


def attention_factor(scaling: RopeScaling | None) -> float:
    """What YaRN multiplies cos and sin by (1 for the other scalings)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(torch.nn.Module):
    inv_freq: torch.Tensor  # [D/2] float32, a non-persistent buffer

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)
        self.attention_factor = attention_factor(scaling)  # cos and sin scaled by it (YaRN), as the reference

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; query: [T, H, D]; key: [T, KVH, D] → rotated (same shapes and dtype)."""
        cos, sin = self.cos_sin(positions, query.dtype)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each position's angles, [T, 1, D/2] each: one half of HF's cat((freqs, freqs))."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2], fp32 like HF
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, N, D] (any strides); cos/sin: [T, 1, D/2] → x rotated, written to `out` (or a new tensor).

    HF computes x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin). Per half that is
    x1*cos - x2*sin and x2*cos + x1*sin, the same roundings (negating is exact), so
    the result is bitwise HF's, in four half-size products instead of a concatenation
    and four full-size passes.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    return out
