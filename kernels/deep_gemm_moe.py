"""MoE on DeepGEMM's grouped FP8 GEMMs (FACTS §2); registers MOE_BACKENDS "deep_gemm" only where `deep_gemm`
imports and runs a GEMM (checked in a child process, since broken builds segfault; costs nothing where the package
is not installed).

DeepGEMM contract (v2 names; v1's `m_grouped_gemm_fp8_fp8_bf16_nt_*` are taken where v2's are missing):
- prefill, contiguous: `m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, m_indices)`: A (M, K) fp8 with
  1x128 fp32 scales (M, K/128), B (G, N, K) fp8 with 128x128 scales (G, N/128, K/128), d (M, N) bf16,
  m_indices (M,) int32 = the group of each row, -1 on padding rows; every group's rows start on a multiple of 128.
- decode, masked: `m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, masked_m, expected_m)`: A (G, M_max, K),
  d (G, M_max, N); only the first masked_m[g] rows of group g are computed; expected_m is a sizing hint.

Both layouts are built with `moe_align.align_tokens_layout`, the helper the Triton kernels consume: the
contiguous layout IS the aligned layout with block_m = 128 (m_indices = the block's expert per row, -1 where
sorted_token_ids holds the sentinel), and the masked layout is the block_m = 1 layout (pairs sorted by expert)
scattered into per-expert slabs. The Triton tests therefore test the layout contract itself, and
`contiguous_grouped_reference` / `masked_grouped_reference` (plain torch, same signatures as DeepGEMM) let the
CPU tests run this whole backend without DeepGEMM.

No host syncs: all sizes come from (T, top_k, E), so the backend can be captured in CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import TYPE_CHECKING, Optional

import torch

from .gemm import FP8_DTYPE, block_dequant
from .moe import MOE_BACKENDS, MoEBackend

if TYPE_CHECKING:
    from .moe_align import AlignedTokens

GROUP = 128  # FP8 block edge
CONTIGUOUS_ALIGN = 128  # DeepGEMM's M alignment of each group in the contiguous layout


# ---- layouts -------------------------------------------------------------------------------------------------

def _rows_u8(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] for fp8 tensors (gathered through a uint8 view: indexing kernels do not all take fp8)."""
    return t.view(torch.uint8)[index].view(t.dtype) if t.dtype == FP8_DTYPE else t[index]


def contiguous_layout(x_q: torch.Tensor, x_s: torch.Tensor, aligned: AlignedTokens, top_k: int,
                      align: int = CONTIGUOUS_ALIGN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows in the aligned layout: A (rows, H) fp8, scales (rows, H/128), m_indices (rows,).

    Padding rows copy some valid row (m_indices -1 tells the GEMM to skip them). DeepGEMM needs segments aligned
    to 128 rows (`align`); our Triton version of its GEMM also takes 64 (triton_grouped_gemm.py)."""
    assert aligned.block_m % align == 0, f"the contiguous layout needs {align}-row segments"
    from .moe_align import row_experts  # NOTE: moe_align imports triton; this module must not at import

    pairs = aligned.num_pairs
    token = aligned.sorted_token_ids.long().clamp(max=max(pairs - 1, 0)) // top_k  # (rows,)
    return _rows_u8(x_q, token), x_s[token], row_experts(aligned)


def masked_layout(x_q: torch.Tensor, x_s: torch.Tensor, aligned: AlignedTokens, top_k: int, num_experts: int,
                  m_max: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert slabs from the block_m = 1 layout: A (E, m_max, H), scales (E, m_max, H/128), masked_m (E,)
    int32, and the slab row (flat over E * m_max) of every pair. Rows past masked_m[e] are left unset."""
    assert aligned.block_m == 1, "the masked layout is built from the unpadded (block_m = 1) layout"
    pairs = aligned.num_pairs
    hidden, groups = x_q.shape[1], x_s.shape[1]
    expert = aligned.expert_ids.long()  # (P,): with block_m = 1 every row is a block
    rank = torch.arange(pairs, device=x_q.device) - aligned.expert_offsets.long()[expert]
    slot = expert * m_max + rank  # (P,) flat slab row of each sorted row
    token = aligned.sorted_token_ids.long() // top_k
    a = torch.empty(num_experts * m_max, hidden, dtype=x_q.dtype, device=x_q.device)
    a.view(torch.uint8)[slot] = _rows_u8(x_q, token).view(torch.uint8)
    sa = torch.empty(num_experts * m_max, groups, dtype=x_s.dtype, device=x_s.device)
    sa[slot] = x_s[token]
    row_of_pair = torch.empty(pairs, dtype=torch.long, device=x_q.device)
    row_of_pair[aligned.sorted_token_ids.long()] = slot
    return (a.view(num_experts, m_max, hidden), sa.view(num_experts, m_max, groups), aligned.expert_counts,
            row_of_pair)


# ---- the DeepGEMM contract in plain torch (CPU tests) ----------------------------------------------------------

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


class TorchDeepGemmOps:
    """Stands in for the `deep_gemm` module: the two grouped GEMMs as the torch references above."""

    m_grouped_fp8_gemm_nt_contiguous = staticmethod(contiguous_grouped_reference)
    m_grouped_fp8_gemm_nt_masked = staticmethod(masked_grouped_reference)


# ---- the backend -------------------------------------------------------------------------------------------

_PROBE = """
import torch, deep_gemm
if not torch.cuda.is_available():
    raise SystemExit(0)
f = getattr(deep_gemm, "fp8_gemm_nt", None) or deep_gemm.gemm_fp8_fp8_bf16_nt
a = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn)
sa, sb = torch.ones(128, 2, device="cuda"), torch.ones(1, 2, device="cuda")
d = torch.empty(128, 128, device="cuda", dtype=torch.bfloat16)
f((a, sa), (b, sb), d)
torch.cuda.synchronize()
"""


def probe_deep_gemm(timeout_s: float = 300.0) -> Optional[str]:
    """None if deep_gemm imports and runs one tiny GEMM in a child process, else why not.

    NOTE: DeepGEMM builds have segfaulted at import or first call with torch 2.11 + CUDA 13 (FACTS §2); a
    segfault cannot be caught in-process, so the first contact happens in a child (only where the package is
    installed: elsewhere this costs nothing)."""
    if importlib.util.find_spec("deep_gemm") is None:
        return "deep_gemm is not installed"
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"importing deep_gemm took more than {timeout_s:.0f} s"
    if proc.returncode != 0:
        return f"deep_gemm failed in a child process (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return None


def _op(module, v2: str, v1: str):
    fn = getattr(module, v2, None) or getattr(module, v1, None)
    if fn is None:
        raise RuntimeError(f"deep_gemm has neither {v2} nor {v1}")
    return fn


class DeepGemmMoE(MoEBackend):
    """Block-FP8 experts on DeepGEMM: masked layout for T <= masked_max_tokens (decode), contiguous above.

    ops: an object with DeepGEMM's two grouped GEMMs; default the `deep_gemm` module (registered only once a
    child process imported it and ran a GEMM), `TorchDeepGemmOps()` in the CPU tests. Non-FP8 weights go to the
    Triton backend (DeepGEMM is FP8 only)."""

    graph_safe = True

    def __init__(self, ops=None, masked_max_tokens: int = 128, m_max_align: int = 16):
        if ops is None:
            import deep_gemm  # only registered after probe_deep_gemm() passed

            ops = deep_gemm
        self._contiguous = _op(ops, "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous")
        self._masked = _op(ops, "m_grouped_fp8_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked")
        self.masked_max_tokens = masked_max_tokens
        self.m_max_align = m_max_align
        # NOTE: kernel modules import triton, so they are imported here, not at module import (triton_support.py).
        from . import moe_align, triton_fp8, triton_moe_kernels
        from .triton_moe import TritonMoE

        self._align, self._fp8, self._kernels = moe_align, triton_fp8, triton_moe_kernels
        self._fallback = TritonMoE()

    def experts(self, x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, block):
        if w13.dtype != FP8_DTYPE:
            return self._fallback.experts(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, block)
        if tuple(block or ()) != (GROUP, GROUP):
            raise ValueError(f"DeepGEMM takes 128x128 FP8 blocks, got {block}")
        tokens, hidden = x.shape
        if tokens == 0:
            return torch.zeros_like(x)
        x_q, x_s = self._fp8.per_token_group_quant(x if x.stride(1) == 1 else x.contiguous())  # (T, H), (T, H/128)
        if tokens <= self.masked_max_tokens:
            d2, row_of_pair = self._run_masked(x_q, x_s, topk_ids, w13, w2, w13_scale, w2_scale)
        else:
            d2, row_of_pair = self._run_contiguous(x_q, x_s, topk_ids, w13, w2, w13_scale, w2_scale)
        return self._kernels.gather_combine(d2, row_of_pair, topk_weights, x.dtype)

    def _run_contiguous(self, x_q, x_s, topk_ids, w13, w2, w13_scale, w2_scale):
        num_experts, two_inter, _ = w13.shape
        aligned = self._align.align_tokens_layout(topk_ids, num_experts, CONTIGUOUS_ALIGN)
        a, sa, m_indices = contiguous_layout(x_q, x_s, aligned, topk_ids.shape[1])
        rows = a.shape[0]
        d1 = torch.empty(rows, two_inter, dtype=torch.bfloat16, device=a.device)
        self._contiguous((a, sa), (w13, w13_scale), d1, m_indices)
        act, act_s = self._kernels.silu_mul_quant(d1)
        d2 = torch.empty(rows, w2.shape[1], dtype=torch.bfloat16, device=a.device)
        self._contiguous((act, act_s), (w2, w2_scale), d2, m_indices)
        return d2, self._align.inverse_rows(aligned)

    def _run_masked(self, x_q, x_s, topk_ids, w13, w2, w13_scale, w2_scale):
        num_experts, two_inter, _ = w13.shape
        tokens, top_k = topk_ids.shape
        # An expert sees each token at most once, so T rows per expert always suffice.
        m_max = -(-tokens // self.m_max_align) * self.m_max_align
        aligned = self._align.align_tokens_layout(topk_ids, num_experts, 1)
        a, sa, masked_m, row_of_pair = masked_layout(x_q, x_s, aligned, top_k, num_experts, m_max)
        expected_m = max(1, -(-tokens * top_k // num_experts))
        d1 = torch.empty(num_experts, m_max, two_inter, dtype=torch.bfloat16, device=a.device)
        self._masked((a, sa), (w13, w13_scale), d1, masked_m, expected_m)
        act, act_s = self._kernels.silu_mul_quant(d1.view(num_experts * m_max, two_inter))
        hidden = w2.shape[1]
        d2 = torch.empty(num_experts, m_max, hidden, dtype=torch.bfloat16, device=a.device)
        self._masked((act.view(num_experts, m_max, -1), act_s.view(num_experts, m_max, -1)), (w2, w2_scale), d2,
                     masked_m, expected_m)
        return d2.view(num_experts * m_max, hidden), row_of_pair


DEEP_GEMM_UNUSABLE = probe_deep_gemm()  # None where deep_gemm works, else the reason
if DEEP_GEMM_UNUSABLE is None:
    MOE_BACKENDS.register("deep_gemm")(DeepGemmMoE)
