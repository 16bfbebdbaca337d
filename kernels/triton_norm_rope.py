"""RMSNorm and DeepSeek's rotary embedding as single Triton kernels (the torch references are in norm_rope.py).

Why: at decode batch sizes every op is a kernel launch of a few microseconds, and the references are chains of
small ops: RMSNorm is 7-8 kernels (cast, square, mean, add, rsqrt, multiply, cast, scale) and a rotation about 10
(casts, strided halves, four products, two sums, a concat). A DeepSeek layer has four norms and two rotations, the
NextN layer seven norms: in a CUDA graph of a small model such launches are most of a step's.

Both kernels keep the references' rounding steps (normalise in fp32, cast to the input dtype, then scale;
rotate with cos/sin cast to the input dtype and every product and sum rounded to it). Under the CPU interpreter the
rotation matches the reference bit for bit; compiled on a GPU both kernels stay within one rounding step of it
(sum order, rsqrt and fp32 mul-add contraction), which tests/test_gpu_norm_rope.py checks.

Imports triton: imported lazily by norm_rope.py on CUDA tensors, never by pdserve.kernels (see triton_support.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_support import check_device, interpreter_requested, next_pow2, patch_interpreter_for_numpy2

if interpreter_requested():
    patch_interpreter_for_numpy2()


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, inv_d, eps, stride_x, stride_o, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    # mean as sum * (1/D): torch's CUDA mean multiplies by the reciprocal too
    y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_d + eps)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the reference casts back before scaling
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim; x (..., D) with a contiguous last dim (rows may be
    strided, e.g. a split of a wider projection)."""
    check_device(x)
    d = x.shape[-1]
    assert x.stride(-1) == 1 and weight.shape == (d,), (tuple(x.shape), x.stride(), tuple(weight.shape))
    rows = x.reshape(-1, d)  # a view whenever the leading dims are uniformly strided
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        block = next_pow2(d)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, d, 1.0 / d, eps, rows.stride(0), out.stride(0),
                                           BLOCK_D=block, num_warps=4 if block <= 1024 else 8)
    return out.view(x.shape)


@triton.jit
def _round(v, dtype: tl.constexpr):
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_ot, stride_oh, stride_ct,
                 stride_st, HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < H)[:, None]
    row = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
    if INTERLEAVE:  # pairs (x0, x1), (x2, x3), ...
        x1 = tl.load(row + 2 * offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + 2 * offs_d[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    else:  # halves
        x1 = tl.load(row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    c = _round(tl.load(cos_ptr + t * stride_ct + offs_d), dt)[None, :]  # cos/sin in x's dtype, as the reference
    s = _round(tl.load(sin_ptr + t * stride_st + offs_d), dt)[None, :]
    first = _round(_round(x1 * c, dt) - _round(x2 * s, dt), dt)
    second = _round(_round(x2 * c, dt) + _round(x1 * s, dt), dt)
    out = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, first.to(dt), mask=mask)
    tl.store(out + HALF, second.to(dt), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """norm_rope.apply_rope in one kernel: x (T, H, P) (any strides but a contiguous last dim), cos/sin (T, P/2)
    fp32; returns a new contiguous (T, H, P) tensor, [rotated first halves | rotated second halves]."""
    check_device(x)
    t, h, p = x.shape
    assert x.stride(2) == 1 and p % 2 == 0 and cos.shape == sin.shape == (t, p // 2)
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    out = torch.empty(t, h, p, dtype=x.dtype, device=x.device)
    if t:
        _rope_kernel[(t,)](x, cos, sin, out, h, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                           cos.stride(0), sin.stride(0), HALF=p // 2, BLOCK_H=next_pow2(h), INTERLEAVE=interleave,
                           num_warps=4)
    return out
