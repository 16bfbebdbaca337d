"""DeepGEMM's prefill grouped GEMM contract in Triton: `m_grouped_fp8_gemm_nt_contiguous`, with TMA loads.

Contract (as deep_gemm v2; see grouped_contract.py): A (M, K) fp8 with 1x128 fp32 scales (M, K/128), B (G, N, K)
fp8 with 128x128 scales (G, N/128, K/128), d (M, N) bf16, m_indices (M,) int32 = each row's group, -1 on padding
rows, which are left untouched. Every group's rows start on a multiple of `block_m` (DeepGEMM: 128; this kernel
also takes 64, which pads less at ~128 rows per expert).

Why a separate kernel from the fused one (triton_moe_kernels.py): TMA needs each tile's rows contiguous, so A is
permuted into the aligned layout first (one gather) instead of being read through `sorted_token_ids`; in return
the warps do no address arithmetic for the tiles. Accumulation stays exact to the FP8 recipe: each K step's
product starts from zero in the tensor core (its FP8 accumulation keeps about 14 bits) and is scaled and added in
fp32, as DeepGEMM does. DeepGEMM also warp-specializes (a producer warp group for the TMA copies, consumer groups
for wgmma and promotion); Triton 3.6's Hopper warp specialization (`tl.range(..., warp_specialize=True)`)
compiles this kernel but the kernel hangs on Hopper with it, so it is not used.

Imports triton: imported lazily by the backends, never by pdserve.kernels (see triton_support.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .grouped_contract import check_contiguous_shapes
from .triton_support import interpreter_requested, patch_interpreter_for_numpy2

if interpreter_requested():
    patch_interpreter_for_numpy2()

GROUP = 128  # FP8 block edge


@triton.jit(do_not_specialize=["M"])
def _grouped_fp8_contiguous_kernel(a_desc, as_ptr, b_desc, bs_ptr, d_ptr, m_idx_ptr, M, N, K,
                                   stride_asm, stride_asg, stride_bse, stride_bsn, stride_bsk, stride_dm,
                                   GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """d[rows of one block] = A[rows] @ B[g]^T for the BLOCK_M rows of one group g, BLOCK_N columns."""
    pid = tl.program_id(0)
    num_m = M // BLOCK_M
    num_n = N // BLOCK_N
    # Grouped ordering: GROUP_M row blocks (mostly of one group) share each weight tile while it is in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    row0 = pid_m * BLOCK_M
    g = tl.load(m_idx_ptr + row0)  # a block's first row is padding only if the whole block is
    if g < 0:
        return
    b_row0 = g * N + pid_n * BLOCK_N
    offs_m = row0 + tl.arange(0, BLOCK_M)
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + g.to(tl.int64) * stride_bse + ((pid_n * BLOCK_N) // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([row0, kt * BLOCK_K])  # (BLOCK_M, BLOCK_K) fp8
        b = b_desc.load([b_row0, kt * BLOCK_K])  # (BLOCK_N, BLOCK_K) fp8, K-contiguous as wgmma wants
        scale = tl.load(as_ptrs + kt * stride_asg) * tl.load(bs_ptrs + kt * stride_bsk)  # (BLOCK_M,)
        # NOTE: the product starts from zero every K step and is promoted to fp32 here: the tensor core's FP8
        # accumulation keeps only ~14 bits, too few to accumulate all of K = 7168 in it.
        acc += tl.dot(a, b.T) * scale[:, None]
    rows_ok = tl.load(m_idx_ptr + offs_m) >= 0  # padding rows stay untouched
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(d_ptr + offs_m.to(tl.int64)[:, None] * stride_dm + offs_n[None, :], acc.to(d_ptr.dtype.element_ty),
             mask=rows_ok[:, None])


def default_contiguous_config(block_m: int) -> dict:
    """Tiles for `m_grouped_fp8_gemm_nt_contiguous`: the best of `bench_moe_gemm.py --contiguous`'s sweep (64 x 128
    at 4 warps; 128-row blocks need 8 warps to keep the fp32 tile and its K-step product in registers)."""
    return dict(BLOCK_N=128, BLOCK_K=GROUP, GROUP_M=8, num_warps=8 if block_m == 128 else 4, num_stages=4)


def m_grouped_fp8_gemm_nt_contiguous(a_pair: tuple[torch.Tensor, torch.Tensor],
                                     b_pair: tuple[torch.Tensor, torch.Tensor], d: torch.Tensor,
                                     m_indices: torch.Tensor, block_m: int = 128,
                                     config: Optional[dict] = None) -> None:
    """DeepGEMM's contiguous grouped GEMM (see the module docstring); `block_m` is the layout's row alignment.
    A config with "KERNEL": "gluon" runs the Gluon version (gluon_grouped_gemm.py, Hopper only) instead."""
    if config and config.get("KERNEL", "triton") != "triton":
        if config["KERNEL"] != "gluon":
            raise ValueError(f"unknown grouped GEMM kernel {config['KERNEL']!r}: triton or gluon")
        from .gluon_grouped_gemm import m_grouped_fp8_gemm_nt_contiguous as gluon_gemm

        return gluon_gemm(a_pair, b_pair, d, m_indices, block_m, {k: v for k, v in config.items() if k != "KERNEL"})
    (a, sa), (b, sb) = a_pair, b_pair
    rows, k = a.shape
    groups, n, _ = b.shape
    check_contiguous_shapes(a, b, d, m_indices, block_m)
    cfg = dict(config or default_contiguous_config(block_m))
    cfg.pop("KERNEL", None)
    block_n = cfg.pop("BLOCK_N")
    if n % block_n or GROUP % block_n or cfg.pop("BLOCK_K", GROUP) != GROUP or k % 16:
        raise ValueError(f"N = {n} must be a multiple of BLOCK_N = {block_n} (which must divide 128), BLOCK_K must "
                         f"be 128 and K = {k} a multiple of 16")
    assert a.stride(1) == 1 and b.is_contiguous() and d.stride(1) == 1
    if rows == 0:
        return
    a_desc = TensorDescriptor.from_tensor(a, [block_m, GROUP])
    b_desc = TensorDescriptor(b.view(groups * n, k), [groups * n, k], [k, 1], [block_n, GROUP])
    grid = ((rows // block_m) * (n // block_n),)
    _grouped_fp8_contiguous_kernel[grid](
        a_desc, sa, b_desc, sb, d, m_indices, rows, n, k, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        sb.stride(2), d.stride(0), GROUP_N=GROUP, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, **cfg)
