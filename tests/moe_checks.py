"""Shared by the MoE kernel tests (CPU interpreter and GPU): a plain-torch MoE reference that can follow the FP8
recipe of the kernels, and the property checks of the aligned token layout (moe_align.py's contract)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.gemm import FP8_DTYPE, block_dequant, per_token_group_quant


def moe_reference(x, topk_weights, topk_ids, w13, w2, w13_scale=None, w2_scale=None, quantize_activations=False,
                  dtype=torch.float64):
    """sum_k w_k * expert_k(x) in `dtype`, expert by expert. With quantize_activations, x and the SiLU-and-mul
    activation are quantized per token per 128 channels first, as the FP8 kernels do (the same torch quantizer
    as the reference GEMM backend)."""
    inter = w2.shape[-1]
    if quantize_activations:
        xq, xs = per_token_group_quant(x.float())
        xd = block_dequant(xq, xs, (1, 128), dtype)
    else:
        xd = x.to(dtype)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        if w13.dtype == FP8_DTYPE:
            w13_e = block_dequant(w13[e], w13_scale[e], (128, 128), dtype)
            w2_e = block_dequant(w2[e], w2_scale[e], (128, 128), dtype)
        else:
            w13_e, w2_e = w13[e].to(dtype), w2[e].to(dtype)
        gate_up = xd[token] @ w13_e.T  # (n, 2I)
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        if quantize_activations:
            hq, hs = per_token_group_quant(h.float())
            h = block_dequant(hq, hs, (1, 128), dtype)
        out.index_add_(0, token, (h @ w2_e.T) * topk_weights[token, slot, None].to(dtype))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude."""
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30)).item()


def check_aligned_layout(a, topk_ids, num_experts, block_m, max_rows):
    """The layout contract of moe_align (also DeepGEMM's contiguous layout at block_m = 128)."""
    pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    dev = flat.device
    assert a.sorted_token_ids.shape == (max_rows,) and a.expert_ids.shape == (max_rows // block_m,)
    counts = torch.bincount(flat, minlength=num_experts)
    assert torch.equal(a.expert_counts.long(), counts)
    padded = (counts + block_m - 1) // block_m * block_m
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    assert torch.equal(a.expert_offsets.long(), torch.cat([zero, padded.cumsum(0)]))
    used = int(a.num_tokens_post_padded)
    assert used == int(padded.sum()) and used % block_m == 0
    sid = a.sorted_token_ids.long()
    assert (sid[used:] == pairs).all(), "rows past the end hold the sentinel"
    assert (a.expert_ids[used // block_m:] == -1).all()
    valid = sid[:used] < pairs
    assert torch.equal(sid[:used][valid].sort().values, torch.arange(pairs, device=dev)), "every pair exactly once"
    # Row r of [0, used) belongs to the expert whose padded segment holds it; valid rows come first in a segment.
    row = torch.arange(used, device=dev)
    owner = torch.searchsorted(padded.cumsum(0), row, right=True)
    assert torch.equal(a.expert_ids[:used // block_m].long(), owner[::block_m]), "expert of each block"
    assert torch.equal(flat[sid[:used][valid]], owner[valid]), "rows of a segment belong to its expert"
    rank = row - a.expert_offsets.long()[owner]
    assert torch.equal(valid, rank < counts[owner]), "pairs first, then padding, in every segment"
