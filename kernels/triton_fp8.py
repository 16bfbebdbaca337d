"""Triton kernels for block-FP8 GEMMs: per-token-group activation quantization and the block-scaled GEMM.

Format (same as `gemm.py`'s torch reference, FACTS §5): weight fp8 e4m3 (N, K) with fp32 scale_inv
(ceil(N/128), ceil(K/128)); activations quantized per token per 128 channels to e4m3 with fp32 scales
(M, ceil(K/128)); y = (x_q * x_scale) @ (W_q * W_scale)^T accumulated in fp32. Edge blocks (K or N not multiples
of 128) are zero-padded by masked loads. No host syncs: CUDA-graph safe.

Imports triton: imported lazily by the backends (triton_gemm.py, triton_moe.py), never by pdserve.kernels
(see triton_support.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .gemm import FP8_DTYPE, FP8_MAX, INV_FP8_MAX
from .triton_support import interpreter_requested, num_sms, patch_interpreter_for_numpy2

if interpreter_requested():
    patch_interpreter_for_numpy2()

GROUP = 128  # activation group and weight block edge: the only FP8 block shape these kernels take


@triton.jit(do_not_specialize=["M", "M_OUT"])
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_qm, stride_sm, stride_sg,
                        GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, FP8_MAX_C: tl.constexpr,
                        INV_FP8_MAX_C: tl.constexpr):
    """One program: BLOCK_M rows x one group of GROUP_SIZE channels. Rows in [M, M_OUT) are padding (zeros)."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    col_ok = cols < K
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :],
                mask=(rows[:, None] < M) & col_ok[None, :], other=0.0).to(tl.float32)
    # NOTE: the scale is amax times the fp32 reciprocal of FP8_MAX and the codes use div_rn (IEEE division; plain
    # `/` is approximate on the GPU), exactly the torch reference's arithmetic, so both match bit for bit.
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) * INV_FP8_MAX_C  # (BLOCK_M,)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    out_rows = rows < M_OUT
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=out_rows[:, None] & col_ok[None, :])
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g * stride_sg, scale, mask=out_rows)


def per_token_group_quant(x: torch.Tensor, group: int = GROUP, column_major_scales: bool = False,
                          pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) activations -> fp8 e4m3 (M', K) and fp32 scales (M', ceil(K/group)), M' = M rounded up to
    `pad_rows_to` (padding rows are zeros). Same values as `gemm.per_token_group_quant`.

    column_major_scales: the scales tensor has strides (1, M') (cuBLAS's BlockWise1x128 layout)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "per_token_group_quant wants (M, K) with contiguous rows"
    m, k = x.shape
    m_out = -(-m // pad_rows_to) * pad_rows_to
    groups = -(-k // group)
    q = torch.empty(m_out, k, dtype=FP8_DTYPE, device=x.device)
    if column_major_scales:
        scale = torch.empty(groups, m_out, dtype=torch.float32, device=x.device).t()  # (M', G) strides (1, M')
    else:
        scale = torch.empty(m_out, groups, dtype=torch.float32, device=x.device)
    if m_out == 0 or k == 0:
        return q, scale
    block_m = 16 if m_out >= 16 else triton.next_power_of_2(m_out)
    grid = (triton.cdiv(m_out, block_m), groups)
    _group_quant_kernel[grid](x, q, scale, m, m_out, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
                              GROUP_SIZE=group, BLOCK_M=block_m, FP8_MAX_C=FP8_MAX,
                              INV_FP8_MAX_C=INV_FP8_MAX, num_warps=4)
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _block_fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                           stride_am, stride_bn, stride_cs, stride_cm, stride_asm, stride_asg, stride_bsn,
                           stride_bsk,
                           GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr):
    """C[M, N] (+= per split) = sum_k dot(A_q, B_q^T) * a_scale[m, k/128] * b_scale[n/128, k/128].

    A (M, K) fp8 row-major; B (N, K) fp8 row-major, loaded as K x N tiles (K-contiguous, what wgmma wants).
    With SPLIT_K > 1, program axis 1 takes a slice of the K tiles and C is an fp32 (SPLIT_K, M, N) workspace."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row tiles share each weight column tile while it is in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_lo = pid_k * per_split
    k_hi = tl.minimum(k_lo + per_split, k_tiles)

    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (k_lo * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + (k_lo * BLOCK_K + offs_k)[:, None]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (offs_n // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(k_lo, k_hi):
        k0 = kt * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        g = k0 // GROUP_K
        a_s = tl.load(as_ptrs + g * stride_asg, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + g * stride_bsk, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    c_ptrs = c_ptr + pid_k * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["numel"])
def _split_k_reduce_kernel(ws_ptr, c_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


def dense_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """Tile sizes for `block_fp8_matmul` (heuristic; BLOCK_K = 128 = one scale group per step).

    Small M (decode) is weight-bandwidth bound: narrow N tiles plus split-K give every SM work."""
    if m <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = dict(BLOCK_M=32 if m <= 32 else 64, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4)
    elif m <= 512:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)
    split = 1
    if m <= 64:
        tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        k_tiles = triton.cdiv(k, cfg["BLOCK_K"])
        while tiles * split < num_sms and split * 2 <= min(8, k_tiles // 2):
            split *= 2
    cfg["SPLIT_K"] = split
    return cfg


def block_fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16, config: Optional[dict] = None) -> torch.Tensor:
    """(M, K) fp8 x (M, ceil(K/128)) scales  @  ((N, K) fp8 x (ceil(N/128), ceil(K/128)) scales)^T -> (M, N)."""
    m, k = a.shape
    n, kb = b.shape
    assert k == kb and a.stride(1) == 1 and b.stride(1) == 1, "block_fp8_matmul wants K-contiguous A and B"
    assert a_scale.shape == (m, triton.cdiv(k, GROUP)) and b_scale.shape == (triton.cdiv(n, GROUP),
                                                                            triton.cdiv(k, GROUP))
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    cfg = dict(config or dense_config(m, n, k, num_sms(a.device)))
    split = cfg.pop("SPLIT_K", 1)
    assert GROUP % cfg["BLOCK_K"] == 0, "a K tile must stay inside one scale group"
    target = c if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    _block_fp8_gemm_kernel[grid](
        a, a_scale, b, b_scale, target, m, n, k, a.stride(0), b.stride(0), m * n if split > 1 else 0, n,
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        GROUP_N=GROUP, GROUP_K=GROUP, SPLIT_K=split, EVEN_K=k % cfg["BLOCK_K"] == 0, **cfg)
    if split > 1:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](target, c, m * n, SPLIT_K=split, BLOCK=block)
    return c
