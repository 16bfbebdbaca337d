"""The "deep_gemm" MoE backend: block-FP8 experts on DeepGEMM's grouped FP8 GEMMs (FACTS §2), the contiguous
layout for prefill and the masked layout for decode (grouped_contract.py has both layouts and the contract); batches
where our Triton fused MoE is faster (every decode batch) go to it instead (TRITON_MAX_TOKENS).

Registered wherever the deep_gemm package is installed; whether it runs here (the right torch, a Hopper GPU) is
checked once, in a child process, when a backend is resolved or this one is built (deep_gemm_ops.py), so that
`--moe-backend deep_gemm` on a machine where it cannot run fails with the reason. The torch references of the
contract (`TorchDeepGemmOps`) let the CPU tests run this whole backend without DeepGEMM.

Scales (checked on the GPU with random scales, tests/test_gpu_deep_gemm.py): fp32; weights 128x128 as
(E, N/128, K/128), the checkpoint's layout; activations 1x128 per row, which DeepGEMM takes row-major (rows, K/128)
and copies into its TMA-aligned MN-major layout (`transform_sf_into_required_layout`, sm_90), so the layouts here
are built MN-major already (strides (1, rows)), saving that copy.

No host syncs: all sizes come from (T, top_k, E), so the backend can be captured in CUDA graphs; the masked GEMM's
`expected_m` (a tile-size hint) is T * top_k / E of the captured batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import deep_gemm_ops
from .gemm import FP8_DTYPE
# Re-exported: the contract's layouts and references were defined here before grouped_contract.py held them.
from .grouped_contract import (CONTIGUOUS_ALIGN, GROUP, contiguous_grouped_reference, contiguous_layout,  # noqa: F401
                               masked_grouped_reference, masked_layout, scatter_to_slabs)
from .moe import MOE_BACKENDS, MoEBackend


# NOTE: the masked GEMM computes and stores whole BLOCK_M-row tiles (64 or 128 on sm_90) of each group's slab, rows
# past masked_m included, so every slab must hold whole tiles: with 16-row slabs a group's tile overwrote the next
# groups' rows (sgl-deep-gemm 0.1.4.post1), with 128-row slabs it is exact.
MASKED_M_ALIGN = 128
# Up to this many tokens the Triton fused MoE is faster than DeepGEMM's contiguous grouped GEMMs (see
# benchmarks/results/README.md, `moe` / DeepGEMM), so the backend hands such batches to it. The masked layout needs
# E x T-row slabs (gigabytes of transient buffers at prefill sizes) and trails Triton at every decode batch, so it is
# used only when asked for (triton_max_tokens=0). Applies to the real DeepGEMM only: with stand-in ops every size
# runs the contract.
TRITON_MAX_TOKENS = 1536


class TorchDeepGemmOps:
    """Stands in for the `deep_gemm` module: the two grouped GEMMs as the contract's torch references."""

    m_grouped_fp8_gemm_nt_contiguous = staticmethod(contiguous_grouped_reference)
    m_grouped_fp8_gemm_nt_masked = staticmethod(masked_grouped_reference)


class DeepGemmMoE(MoEBackend):
    """Block-FP8 experts on DeepGEMM: T <= triton_max_tokens on the Triton fused MoE (faster there), else the masked
    layout for T <= masked_max_tokens (decode sizes), the contiguous layout above.

    ops: an object with DeepGEMM's grouped GEMMs under any of the names in deep_gemm_ops.OP_NAMES; default the
    `deep_gemm` module (imported only once a child process ran it, deep_gemm_ops.require_usable), and
    `TorchDeepGemmOps()` in the CPU tests. triton_max_tokens: default TRITON_MAX_TOKENS with the real DeepGEMM, 0
    with stand-in ops. Non-FP8 weights go to the Triton backend (DeepGEMM is FP8 only)."""

    graph_safe = True

    def __init__(self, ops=None, masked_max_tokens: int = 128, m_max_align: int = MASKED_M_ALIGN,
                 triton_max_tokens: Optional[int] = None):
        if triton_max_tokens is None:
            triton_max_tokens = TRITON_MAX_TOKENS if ops is None else 0
        self.triton_max_tokens = triton_max_tokens
        if ops is None:
            deep_gemm_ops.require_usable()
            import deep_gemm

            ops = deep_gemm
        self._contiguous = deep_gemm_ops.find_op(ops, "contiguous")
        self._masked = deep_gemm_ops.find_op(ops, "masked")
        # DeepGEMM's row alignment of each expert's segment (128 on sm_90; some builds make it settable).
        align = getattr(ops, "get_m_alignment_for_contiguous_layout", None)
        self.contiguous_align = int(align()) if align is not None else CONTIGUOUS_ALIGN
        self.masked_max_tokens = masked_max_tokens
        self.m_max_align = m_max_align
        # NOTE: kernel modules import triton, so they are imported here, not at module import (triton_support.py).
        from . import moe_align, triton_fp8, triton_moe_kernels
        from .triton_moe import TritonMoE

        self._align, self._fp8, self._kernels = moe_align, triton_fp8, triton_moe_kernels
        self._fallback = TritonMoE()

    def select_experts(self, router_logits, correction_bias, cfg):
        """The Triton backend's fused routing (one kernel per layer), same contract as moe.select_experts."""
        return self._fallback.select_experts(router_logits, correction_bias, cfg)

    def experts(self, x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, block, absent=False):
        if w13.dtype != FP8_DTYPE or x.shape[0] <= self.triton_max_tokens:
            return self._fallback.experts(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, block, absent)
        if tuple(block or ()) != (GROUP, GROUP):
            raise ValueError(f"DeepGEMM takes 128x128 FP8 blocks, got {block}")
        tokens, hidden = x.shape
        if tokens == 0:
            return torch.zeros_like(x)
        x_q, x_s = self._fp8.per_token_group_quant(x if x.stride(1) == 1 else x.contiguous())  # (T, H), (T, H/128)
        # The masked layout has a slab per local expert and no place for another rank's pairs (absent): those
        # batches take the contiguous layout, where such a pair simply holds no row.
        if tokens <= self.masked_max_tokens and not absent:
            d2, row_of_pair = self._run_masked(x_q, x_s, topk_ids, w13, w2, w13_scale, w2_scale)
        else:
            d2, row_of_pair = self._run_contiguous(x_q, x_s, topk_ids, w13, w2, w13_scale, w2_scale)
        return self._kernels.gather_combine(d2, row_of_pair, topk_weights, x.dtype)

    def _run_contiguous(self, x_q, x_s, topk_ids, w13, w2, w13_scale, w2_scale):
        num_experts, two_inter, _ = w13.shape
        aligned = self._align.align_tokens_layout(topk_ids, num_experts, self.contiguous_align)
        a, sa, m_indices = contiguous_layout(x_q, x_s, aligned, topk_ids.shape[1], self.contiguous_align,
                                             mn_major_scales=True)
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
        a, sa, masked_m, row_of_pair = masked_layout(x_q, x_s, aligned, top_k, num_experts, m_max,
                                                     mn_major_scales=True)
        expected_m = max(1, -(-tokens * top_k // num_experts))
        d1 = torch.empty(num_experts, m_max, two_inter, dtype=torch.bfloat16, device=a.device)
        self._masked((a, sa), (w13, w13_scale), d1, masked_m, expected_m)
        # SiLU-and-mul on the pairs' rows only (the slabs are mostly unused rows), back into slabs for the down GEMM.
        act_rows, act_s_rows = self._kernels.silu_mul_quant(d1.view(num_experts * m_max, two_inter)[row_of_pair])
        act = torch.empty(num_experts * m_max, act_rows.shape[1], dtype=act_rows.dtype, device=a.device)
        act.view(torch.uint8)[row_of_pair] = act_rows.view(torch.uint8)
        act_s = scatter_to_slabs(act_s_rows, row_of_pair, num_experts, m_max, mn_major=True)
        hidden = w2.shape[1]
        d2 = torch.empty(num_experts, m_max, hidden, dtype=torch.bfloat16, device=a.device)
        self._masked((act.view(num_experts, m_max, -1), act_s), (w2, w2_scale), d2, masked_m, expected_m)
        return d2.view(num_experts * m_max, hidden), row_of_pair


if deep_gemm_ops.installed():
    MOE_BACKENDS.register("deep_gemm")(DeepGemmMoE)
