"""The model's fast elementwise paths are bitwise the reference formulas they replace."""

from __future__ import annotations

import torch

from servelm.models.llama import RMSNorm
from servelm.models.rotary import RotaryEmbedding, apply_rotary


def _hf_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def test_apply_rotary_is_bitwise_hf_on_a_strided_view():
    rotary = RotaryEmbedding(64, 100000.0, None)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(37, 15 * 64, generator=gen)
    qk = qkv[:, : 12 * 64].view(37, 12, 64)  # q and k heads of a fused projection, row stride 960
    positions = torch.randint(0, 5000, (37,), generator=gen)
    got = apply_rotary(qk, *rotary.cos_sin(positions, torch.float32))
    assert torch.equal(got, _hf_rotate(qk, positions, rotary.inv_freq))


def test_rms_norm_fp32_is_bitwise_the_reference_formula():
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(2)) * 3
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(norm(x), reference)
