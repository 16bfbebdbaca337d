"""DeepGEMM's prefill grouped GEMM contract in Gluon (Triton's tile-level language, Hopper only):
`m_grouped_fp8_gemm_nt_contiguous`, with the block-scale promotion of one K step under the next step's wgmma.

Contract: the same as triton_grouped_gemm.py (A (M, K) fp8 with 1x128 scales, B (G, N, K) fp8 with 128x128
scales, d (M, N) bf16, m_indices (M,) = each row's group, -1 on padding rows, which stay untouched; every group's
rows start on a multiple of `block_m`).

Why Gluon: the FP8 recipe promotes every 128-wide K step's product to fp32 with its scales, because the tensor
core's FP8 accumulation keeps only ~14 bits. In `tl.dot` a product that is scaled before it is
accumulated cannot stay in flight, so Triton waits for every wgmma before its promotion and the tensor core idles
through the scale FMAs. Gluon exposes wgmma's asynchrony: step k's product
is issued into its own registers, then `warpgroup_mma_wait(1)` waits only for step k-1's, which is promoted while
step k runs. DeepGEMM gets the same overlap from two math warp groups plus a TMA producer warp; here both warp
groups run the one loop and TMA refills are issued from it, as in Triton's own pipelined matmuls.

Registers: the tile's fp32 accumulator, the product being promoted and the product in flight, i.e. three
(BLOCK_M x 128) fp32 tiles over the warp groups: 64 x 128 per warp group (4 warps per 64 rows) keeps that at 192
registers a thread. BLOCK_N is therefore 128: one weight-scale block, a scalar per K step.

GPU only (Hopper): Gluon has no CPU interpreter; tests/test_gpu_moe_gemm.py checks it against the contract's torch
reference, and tests/test_gluon_compile.py compiles it for sm_90 on the CPU where Triton ships Gluon.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .grouped_contract import check_contiguous_shapes

# Gluon is experimental and renames things: Triton 3.6 (the device's) has tma.async_copy_global_to_shared and
# gl.thread_barrier; later releases (3.9 here) call them tma.async_load (same arguments) and gl.barrier.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

GROUP = 128  # FP8 block edge = BLOCK_K = BLOCK_N
_EDGE = gl.constexpr(GROUP)  # the same, as kernels see globals


@gluon.jit
def _load_k_step(a_desc, b_desc, a_bufs, b_bufs, bars, stage, row0, b_row0, kt, pred):
    """TMA: A rows [row0, +BLOCK_M) and B rows [b_row0, +BLOCK_N) of K step kt into ring slot `stage`."""
    bar = bars.index(stage)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    _tma_load(a_desc, [row0, kt * _EDGE], bar, a_bufs.index(stage), pred)
    _tma_load(b_desc, [b_row0, kt * _EDGE], bar, b_bufs.index(stage), pred)


@gluon.jit
def _k_step_scale(as_ptrs, bs_base, stride_asg, stride_bsk, kt):
    """(BLOCK_M,) fp32: K step kt's activation scale of each row times the tile's weight scale.
    Loaded before the step's tile wait, so the global loads complete under it."""
    return gl.load(as_ptrs + kt * stride_asg) * gl.load(bs_base + kt * stride_bsk)


@gluon.jit
def _issue_k_step(a_bufs, b_bufs, bars, zero, kt, STAGES: gl.constexpr):
    """Wait for K step kt's tiles and start its wgmma. Its product starts from zero (`use_acc=False`) every K step:
    the tensor core's FP8 accumulation keeps only ~14 bits. Returns the in-flight product."""
    stage = kt % STAGES
    mbarrier.wait(bars.index(stage), (kt // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _refill(a_desc, b_desc, a_bufs, b_bufs, bars, row0, b_row0, kt_done, num_k, STAGES: gl.constexpr,
            num_warps: gl.constexpr):
    """Step kt_done's wgmma has finished: load step kt_done + STAGES into its ring slot (none for kt_done < 0, or
    past K)."""
    if num_warps > 4:
        _cta_barrier()  # every warp group must be past that wgmma before its slot is overwritten
    _load_k_step(a_desc, b_desc, a_bufs, b_bufs, bars, (kt_done + STAGES) % STAGES, row0, b_row0,
                 kt_done + STAGES, (kt_done >= 0) & (kt_done + STAGES < num_k))


@gluon.jit(do_not_specialize=["M"])
def _gluon_grouped_fp8_kernel(a_desc, as_ptr, b_desc, bs_ptr, d_ptr, m_idx_ptr, M, N, K,
                              stride_asm, stride_asg, stride_bse, stride_bsn, stride_bsk, stride_dm,
                              BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                              UNROLL: gl.constexpr, num_warps: gl.constexpr):
    """d[rows of one block] = A[rows] @ B[g]^T for the BLOCK_M rows of one group g, 128 columns."""
    BLOCK_N: gl.constexpr = _EDGE
    pid = gl.program_id(0)
    num_m = M // BLOCK_M
    num_n = N // BLOCK_N
    # Grouped ordering, as in triton_grouped_gemm.py (a triton.jit helper cannot be called from Gluon): GROUP_M
    # row blocks (mostly of one group) share each weight tile in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_rows = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    row0 = pid_m * BLOCK_M
    g = gl.load(m_idx_ptr + row0)  # a block's first row is padding only if the whole block is
    if g < 0:
        return
    b_row0 = g * N + pid_n * BLOCK_N
    num_k = gl.cdiv(K, _EDGE)

    # wgmma tiling: 4 warps (one warp group) per 64 rows, m16 x n128 x k32 instructions.
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, _EDGE], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, _EDGE], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):  # fill the ring
        _load_k_step(a_desc, b_desc, a_bufs, b_bufs, bars, s, row0, b_row0, s, s < num_k)

    offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    as_ptrs = as_ptr + offs_m.to(gl.int64) * stride_asm  # (BLOCK_M,) row scales of K step 0
    bs_base = bs_ptr + g.to(gl.int64) * stride_bse + pid_n * stride_bsn  # the tile's weight-scale row
    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    acc = zero

    # Each K step's wgmma is issued, then the step before it is promoted while it runs. Within an unrolled group
    # of UNROLL steps, `warpgroup_mma_wait(1)` leaves the newest wgmma running; the group's last product is waited
    # for in full (wait(0)) and promoted under the next group's first wgmma.
    # NOTE: no wgmma may be in flight across the loop's back edge: the loop then copies its registers while the
    # tensor core still writes them, and ptxas serializes every wgmma of the kernel (warning C7514).
    done_prev = zero  # the previous step's finished product, and its scale
    scale_prev = gl.zeros([BLOCK_M], dtype=gl.float32, layout=gl.SliceLayout(1, mma))
    main_steps = (num_k // UNROLL) * UNROLL
    for kt0 in range(0, main_steps, UNROLL):
        scale_u = _k_step_scale(as_ptrs, bs_base, stride_asg, stride_bsk, kt0)
        prod_u = _issue_k_step(a_bufs, b_bufs, bars, zero, kt0, STAGES)
        acc += done_prev * scale_prev[:, None]
        _refill(a_desc, b_desc, a_bufs, b_bufs, bars, row0, b_row0, kt0 - 1, num_k, STAGES, num_warps)
        for u in gl.static_range(1, UNROLL):
            scale_next = _k_step_scale(as_ptrs, bs_base, stride_asg, stride_bsk, kt0 + u)
            prod_next = _issue_k_step(a_bufs, b_bufs, bars, zero, kt0 + u, STAGES)
            done = warpgroup_mma_wait(1, deps=(prod_u, ))
            acc += done * scale_u[:, None]
            _refill(a_desc, b_desc, a_bufs, b_bufs, bars, row0, b_row0, kt0 + u - 1, num_k, STAGES, num_warps)
            prod_u = prod_next
            scale_u = scale_next
        done_prev = warpgroup_mma_wait(0, deps=(prod_u, ))
        scale_prev = scale_u
    for kt in range(main_steps, num_k):  # the last num_k % UNROLL steps, one at a time
        scale_u = _k_step_scale(as_ptrs, bs_base, stride_asg, stride_bsk, kt)
        prod_u = _issue_k_step(a_bufs, b_bufs, bars, zero, kt, STAGES)
        acc += done_prev * scale_prev[:, None]
        _refill(a_desc, b_desc, a_bufs, b_bufs, bars, row0, b_row0, kt - 1, num_k, STAGES, num_warps)
        done_prev = warpgroup_mma_wait(0, deps=(prod_u, ))
        scale_prev = scale_u
    acc += done_prev * scale_prev[:, None]
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    rows_ok = gl.load(m_idx_ptr + offs_m) >= 0  # padding rows stay untouched
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    gl.store(d_ptr + offs_m.to(gl.int64)[:, None] * stride_dm + offs_n[None, :], acc.to(d_ptr.dtype.element_ty),
             mask=rows_ok[:, None])


def default_gluon_config(block_m: int) -> dict:
    """Tiles for the Gluon kernel: BLOCK_N is fixed at 128 (see the module docstring); 4 warps per 64 rows."""
    return dict(GROUP_M=8, num_warps=4 * (block_m // 64), STAGES=4, UNROLL=2)


def m_grouped_fp8_gemm_nt_contiguous(a_pair: tuple[torch.Tensor, torch.Tensor],
                                     b_pair: tuple[torch.Tensor, torch.Tensor], d: torch.Tensor,
                                     m_indices: torch.Tensor, block_m: int = 128,
                                     config: Optional[dict] = None) -> None:
    """DeepGEMM's contiguous grouped GEMM (see the module docstring); `block_m` is the layout's row alignment."""
    (a, sa), (b, sb) = a_pair, b_pair
    rows, k = a.shape
    groups, n, _ = b.shape
    check_contiguous_shapes(a, b, d, m_indices, block_m)
    cfg = dict(config or default_gluon_config(block_m))
    if cfg.pop("BLOCK_N", GROUP) != GROUP or cfg.pop("BLOCK_K", GROUP) != GROUP or n % GROUP or k % 16:
        raise ValueError(f"the Gluon grouped GEMM takes 128 x 128 tiles of N and K: N = {n} must be a multiple of "
                         f"128 and K = {k} of 16")
    if block_m not in (64, 128) or cfg["num_warps"] != 4 * (block_m // 64):
        raise ValueError(f"the Gluon grouped GEMM runs 4 warps per 64 rows, block_m 64 or 128; got block_m "
                         f"{block_m} with {cfg['num_warps']} warps")
    assert a.stride(1) == 1 and b.is_contiguous() and d.stride(1) == 1
    if rows == 0:
        return
    layout = gl.NVMMASharedLayout.get_default_for([block_m, GROUP], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [block_m, GROUP], layout)
    b_layout = gl.NVMMASharedLayout.get_default_for([GROUP, GROUP], gl.float8e4nv)
    b_desc = TensorDescriptor(b.view(groups * n, k), [groups * n, k], [k, 1], [GROUP, GROUP], b_layout)
    grid = ((rows // block_m) * (n // GROUP),)
    _gluon_grouped_fp8_kernel[grid](
        a_desc, sa, b_desc, sb, d, m_indices, rows, n, k, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        sb.stride(2), d.stride(0), BLOCK_M=block_m, **cfg)
