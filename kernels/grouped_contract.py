"""DeepGEMM's grouped FP8 GEMM contract, shared by every kernel that follows it: the two token layouts, the shape
check, and the contract in plain torch (the references the kernels are tested against).

- prefill, contiguous: `m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, m_indices)`: A (M, K) fp8 with
  1x128 fp32 scales (M, K/128), B (G, N, K) fp8 with 128x128 scales (G, N/128, K/128), d (M, N) bf16,
  m_indices (M,) int32 = the group of each row, -1 on padding rows; every group's rows start on a multiple of 128.
- decode, masked: `masked((a, sa), (b, sb), d, masked_m, expected_m)`: A (G, M_max, K), d (G, M_max, N); only the
  first masked_m[g] rows of group g are computed; expected_m is a sizing hint.

Both layouts are built with `moe_align.align_tokens_layout`, the helper the Triton kernels consume: the
contiguous layout IS the aligned layout with block_m = 128 (m_indices = the block's expert per row, -1 where
sorted_token_ids holds the sentinel), and the masked layout is the block_m = 1 layout (pairs sorted by expert)
scattered into per-expert slabs.

Implemented by DeepGEMM (deep_gemm_moe.py), our Triton and Gluon grouped GEMMs (triton_grouped_gemm.py,
gluon_grouped_gemm.py) and the Triton MoE's contiguous path (triton_moe_kernels.py), which all import this module
and none of each other's. Imports no triton at module import (moe_align does, so it is imported where used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .gemm import FP8_DTYPE, block_dequant

if TYPE_CHECKING:
    from .moe_align import AlignedTokens

GROUP = 128  # FP8 block edge
CONTIGUOUS_ALIGN = 128  # DeepGEMM's M alignment of each group in the contiguous layout


def rows_u8(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] for fp8 tensors (gathered through a uint8 view: indexing kernels do not all take fp8)."""
    return t.view(torch.uint8)[index].view(t.dtype) if t.dtype == FP8_DTYPE else t[index]


def contiguous_layout(x_q: torch.Tensor, x_s: torch.Tensor, aligned: AlignedTokens, top_k: int,
                      align: int = CONTIGUOUS_ALIGN,
                      mn_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows in the aligned layout: A (rows, H) fp8, scales (rows, H/128), m_indices (rows,).

    Padding rows copy some valid row (m_indices -1 tells the GEMM to skip them). DeepGEMM needs segments aligned
    to 128 rows (`align`); our Triton version of its GEMM also takes 64 (triton_grouped_gemm.py).
    mn_major_scales: the scales with strides (1, rows), DeepGEMM's own layout on sm_90 (rows is a multiple of 4),
    which it would otherwise copy the row-major scales into."""
    assert aligned.block_m % align == 0, f"the contiguous layout needs {align}-row segments"
    from .moe_align import row_experts  # NOTE: moe_align imports triton; this module must not at import

    pairs = aligned.num_pairs
    token = aligned.sorted_token_ids.long().clamp(max=max(pairs - 1, 0)) // top_k  # (rows,)
    scales = x_s.t()[:, token].t() if mn_major_scales else x_s[token]  # (rows, H/128)
    return rows_u8(x_q, token), scales, row_experts(aligned)


def masked_layout(x_q: torch.Tensor, x_s: torch.Tensor, aligned: AlignedTokens, top_k: int, num_experts: int,
                  m_max: int, mn_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor]:
    """Per-expert slabs from the block_m = 1 layout: A (E, m_max, H), scales (E, m_max, H/128), masked_m (E,)
    int32, and the slab row (flat over E * m_max) of every pair. Rows past masked_m[e] are left unset.
    mn_major_scales: scales with strides (H/128 * m_max, 1, m_max) (DeepGEMM's layout; m_max a multiple of 4)."""
    assert aligned.block_m == 1, "the masked layout is built from the unpadded (block_m = 1) layout"
    pairs = aligned.num_pairs
    hidden = x_q.shape[1]
    expert = aligned.expert_ids.long()  # (P,): with block_m = 1 every row is a block
    rank = torch.arange(pairs, device=x_q.device) - aligned.expert_offsets.long()[expert]
    slot = expert * m_max + rank  # (P,) flat slab row of each sorted row
    token = aligned.sorted_token_ids.long() // top_k
    a = torch.empty(num_experts * m_max, hidden, dtype=x_q.dtype, device=x_q.device)
    a.view(torch.uint8)[slot] = rows_u8(x_q, token).view(torch.uint8)
    row_of_pair = torch.empty(pairs, dtype=torch.long, device=x_q.device)
    row_of_pair[aligned.sorted_token_ids.long()] = slot
    sa = scatter_to_slabs(x_s[token], slot, num_experts, m_max, mn_major_scales)
    return a.view(num_experts, m_max, hidden), sa, aligned.expert_counts, row_of_pair


def scatter_to_slabs(values: torch.Tensor, slot: torch.Tensor, num_experts: int, m_max: int,
                     mn_major: bool = False) -> torch.Tensor:
    """(P, C) rows -> (E, m_max, C) slabs, row p at flat slab row slot[p]; other rows unset. mn_major: the slabs
    are stored (E, C, m_max) and returned transposed (strides (C * m_max, 1, m_max))."""
    cols = values.shape[1]
    if not mn_major:
        slabs = torch.empty(num_experts * m_max, cols, dtype=values.dtype, device=values.device)
        slabs[slot] = values
        return slabs.view(num_experts, m_max, cols)
    slabs = torch.empty(num_experts, cols, m_max, dtype=values.dtype, device=values.device)
    slabs[slot // m_max, :, slot % m_max] = values
    return slabs.transpose(1, 2)


def check_contiguous_shapes(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, m_indices: torch.Tensor,
                            block_m: int) -> None:
    """ValueError unless A (M, K), B (G, N, K), d (M, N), m_indices (M,) follow the contiguous layout in fp8."""
    rows, k = a.shape
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise ValueError(f"m_grouped_fp8_gemm_nt_contiguous takes fp8 A and B, got {a.dtype} and {b.dtype}")
    if b.shape[2] != k or rows % block_m or m_indices.shape != (rows,) or d.shape != (rows, b.shape[1]):
        raise ValueError(f"shapes do not follow the contiguous layout: A {tuple(a.shape)}, B {tuple(b.shape)}, "
                         f"d {tuple(d.shape)}, m_indices {tuple(m_indices.shape)}, block_m {block_m}")


# ---- the contract in plain torch ------------------------------------------------------------------------------

def contiguous_grouped_reference(a_pair: tuple[torch.Tensor, torch.Tensor], b_pair: tuple[torch.Tensor, torch.Tensor],
                                 d: torch.Tensor, m_indices: torch.Tensor, block_m: int = CONTIGUOUS_ALIGN) -> None:
    """d[r] = dequant(a[r]) @ dequant(b[m_indices[r]])^T for rows with m_indices >= 0; other rows untouched."""
    (a, sa), (b, sb) = a_pair, b_pair
    assert a.shape[0] % block_m == 0, f"the contiguous layout has M aligned to {block_m}"
    a_deq = block_dequant(a, sa, (1, GROUP))  # (M, K) fp32
    for g in torch.unique(m_indices[m_indices >= 0]).tolist():
        rows = torch.nonzero(m_indices == g).squeeze(1)
        d[rows] = (a_deq[rows] @ block_dequant(b[g], sb[g], (GROUP, GROUP)).T).to(d.dtype)


def masked_grouped_reference(a_pair: tuple[torch.Tensor, torch.Tensor], b_pair: tuple[torch.Tensor, torch.Tensor],
                             d: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
    """d[g, :masked_m[g]] = dequant(a[g, :masked_m[g]]) @ dequant(b[g])^T; other rows untouched."""
    (a, sa), (b, sb) = a_pair, b_pair
    for g, m in enumerate(masked_m.tolist()):
        if m:
            a_deq = block_dequant(a[g, :m], sa[g, :m], (1, GROUP))
            d[g, :m] = (a_deq @ block_dequant(b[g], sb[g], (GROUP, GROUP)).T).to(d.dtype)


def dense_reference(a_pair: tuple[torch.Tensor, torch.Tensor], b_pair: tuple[torch.Tensor, torch.Tensor],
                    d: torch.Tensor) -> None:
    """DeepGEMM's `fp8_gemm_nt` in torch: d = dequant(a) @ dequant(b)^T, a (M, K) with 1x128 scales, b (N, K)
    with 128x128 scales."""
    (a, sa), (b, sb) = a_pair, b_pair
    d.copy_(block_dequant(a, sa, (1, GROUP)) @ block_dequant(b, sb, (GROUP, GROUP)).T)
