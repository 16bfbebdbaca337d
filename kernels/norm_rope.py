"""RMSNorm and rotary embedding (DeepSeek's YaRN variant): the torch references, and the dispatch that sends CUDA
tensors to one-kernel Triton versions (triton_norm_rope.py), which matter at decode sizes where every small op is
a launch. PDSERVE_TORCH_NORM_ROPE=1 keeps CUDA on the references (to compare, or to rule the kernels out)."""

from __future__ import annotations

import functools
import math
import os

import torch

from .triton_support import triton_installed


@functools.lru_cache(maxsize=None)
def _fused():
    """The Triton module, or None (no triton, or PDSERVE_TORCH_NORM_ROPE=1). Imported on first CUDA use only."""
    if os.environ.get("PDSERVE_TORCH_NORM_ROPE", "0") == "1" or not triton_installed():
        return None
    from . import triton_norm_rope

    return triton_norm_rope


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """The kernels have no backward: anything autograd would track stays on the references."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and x.stride(-1) == 1 and not _needs_grad(x, weight) and _fused() is not None:
        return _fused().rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x (tokens, heads, dim) by per-token angles; see apply_rope_reference."""
    half = x.shape[-1] // 2
    if (x.is_cuda and x.dim() == 3 and x.stride(-1) == 1 and half & (half - 1) == 0 and cos.stride(-1) == 1
            and sin.stride(-1) == 1 and not _needs_grad(x) and _fused() is not None):
        return _fused().apply_rope(x, cos, sin, interleave)
    return apply_rope_reference(x, cos, sin, interleave)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32, cast back, then scale: the same rounding order as DeepSeek's and transformers' RMSNorm.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_pos: int, beta_fast: float,
                  beta_slow: float) -> torch.Tensor:
    """Inverse frequencies (dim/2,) with YaRN's ramp between interpolated and extrapolated frequencies."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (tokens, dim/2) in fp32 for the given positions."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # (tokens, dim/2)
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x (tokens, heads, dim) by per-token angles; cos/sin are (tokens, dim/2).

    interleave=True rotates pairs (x0, x1), (x2, x3), ... and returns them de-interleaved
    ([rotated evens | rotated odds]), exactly as transformers does; the dot products q.k are unchanged by that
    permutation because q_pe and k_pe (the cached key) are permuted alike.
    """
    cos = cos[:, None, :].to(x.dtype)  # (tokens, 1, dim/2)
    sin = sin[:, None, :].to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
