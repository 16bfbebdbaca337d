"""Cases shared by the CPU-interpreter and GPU tests of the fused RMSNorm / RoPE kernels (triton_norm_rope.py)."""

from __future__ import annotations

import torch

from pdserve.kernels.norm_rope import apply_rope_reference, rms_norm_reference, rope_cos_sin, yarn_inv_freq


def norm_case(rows: int, dim: int, dtype, device, seed: int, strided: bool):
    """x (rows, dim), as a split of a wider projection when strided (rows not contiguous), and a weight."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, dim + (24 if strided else 0), generator=gen) * 3
    x = wide.to(dtype).to(device)[:, :dim]
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype).to(device)
    return x, weight


def check_rms_norm(fused, rows: int, dim: int, dtype, device, seed: int = 0, strided: bool = True) -> float:
    """The fused kernel against the reference; returns the largest error in units of the output's dtype epsilon
    (relative to each element)."""
    x, weight = norm_case(rows, dim, dtype, device, seed, strided)
    ref = rms_norm_reference(x, weight, 1e-6)
    out = fused.rms_norm(x, weight, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rel = ((out.double() - ref.double()).abs() / ref.double().abs().clamp(min=1e-3)).max().item()
    return rel / torch.finfo(dtype).eps


def rope_case(tokens: int, heads: int, dim: int, dtype, device, seed: int):
    """q_pe as a strided slice of a (T, H, nope + rope) projection, and YaRN cos/sin at scattered positions."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, 16 + dim, generator=gen).to(dtype).to(device)
    x = q[..., 16:]
    inv_freq = yarn_inv_freq(dim, 10000.0, 40.0, 4096, 32.0, 1.0)
    positions = torch.randint(0, 100000, (tokens,), generator=gen).to(device)
    cos, sin = rope_cos_sin(inv_freq, positions, 1.2)
    return x, cos, sin


def check_rope(fused, tokens: int, heads: int, dim: int, dtype, device, interleave: bool, seed: int = 0) -> float:
    """The largest difference from the reference in units of dtype's epsilon, relative to the largest element of
    its (token, head) row: a difference in one product's rounding survives the cancellation in x1*cos - x2*sin, so
    per-element relative error would be unbounded. (Both round every product and sum to dtype; the CPU interpreter
    matches exactly.)"""
    x, cos, sin = rope_case(tokens, heads, dim, dtype, device, seed)
    ref = apply_rope_reference(x, cos, sin, interleave)
    out = fused.apply_rope(x, cos, sin, interleave)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    return rope_error(out, ref) / torch.finfo(dtype).eps


def rope_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.double().abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
    return ((out.double() - ref.double()).abs() / scale).max().item()
