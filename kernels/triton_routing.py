"""Fused MoE routing: the whole of `moe.select_experts` in one Triton program per token.

Why a kernel: the torch reference is ~12 small launches per MoE layer (sigmoid, add, view/topk per group, sum,
topk of groups, scatter, masked_fill, topk, gather, sum, div); at decode batch sizes each costs more than the
math. Both versions are free of host syncs, so either can be captured in a CUDA graph.

Same result as `select_experts`: identical expert ids (as a set per token; the kernel lists them best first,
torch.topk(sorted=False) in no promised order) and weights equal up to the order of the fp32 sum that
normalises them (a few ulp). Ties between exactly equal scores go to the lower expert index here; torch.topk
does not promise an order for ties, and random fp32 logits do not produce them.

Imports triton: imported lazily by the "triton" MoE backend, never by pdserve.kernels (see triton_support.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .moe import RoutingConfig, select_experts
from .triton_support import interpreter_requested, next_pow2, patch_interpreter_for_numpy2

if interpreter_requested():
    patch_interpreter_for_numpy2()


@triton.jit
def _argmax_first(x, idx):
    """(value, index) of the maximum of x; among equal maxima the smallest idx."""
    best = tl.max(x)
    return best, tl.min(tl.where(x == best, idx, 1 << 30))


@triton.jit
def _routing_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, num_experts, scaling,
                    N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, G_P: tl.constexpr, PG_P: tl.constexpr,
                    TOP_K: tl.constexpr, TOPK_P: tl.constexpr, TOPK_GROUP: tl.constexpr,
                    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                    GROUP_TOP2: tl.constexpr, MASK_NEG_INF: tl.constexpr, NORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_P)[:, None]
    j = tl.arange(0, PG_P)[None, :]
    valid = (g < N_GROUP) & (j < PER_GROUP)
    expert = g * PER_GROUP + j  # (G_P, PG_P) expert index of each slot
    logit = tl.load(logits_ptr + t * stride_l + expert, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(logit)
    else:
        e = tl.exp(logit - tl.max(tl.max(logit, axis=1), axis=0))
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if GROUPED:
        # Group score: sum of the best two (V3 noaux_tc) or the best one (V2) biased scores of the group.
        first = tl.max(choice, axis=1)  # (G_P,)
        if GROUP_TOP2:
            first_j = tl.min(tl.where(choice == first[:, None], j, PG_P), axis=1)
            rest = tl.where(j == first_j[:, None], float("-inf"), choice)
            group_score = first + tl.max(rest, axis=1)
        else:
            group_score = first
        gi = tl.arange(0, G_P)
        group_score = tl.where(gi < N_GROUP, group_score, float("-inf"))
        keep = gi < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            _, best = _argmax_first(group_score, gi)
            keep = keep | (gi == best)
            group_score = tl.where(gi == best, float("-inf"), group_score)
        # V3 masks the other groups with -inf; V2 with 0 (its softmax scores are all > 0).
        fill = float("-inf") if MASK_NEG_INF else 0.0
        choice = tl.where(keep[:, None] & valid, choice, tl.where(valid, fill, float("-inf")))

    slots = tl.arange(0, TOPK_P)
    weights = tl.zeros((TOPK_P,), dtype=tl.float32)
    ids = tl.zeros((TOPK_P,), dtype=tl.int64)
    flat_choice = tl.reshape(choice, (G_P * PG_P,))
    flat_expert = tl.reshape(expert, (G_P * PG_P,))
    flat_scores = tl.reshape(scores, (G_P * PG_P,))
    for k in tl.static_range(TOP_K):
        _, best = _argmax_first(flat_choice, flat_expert)
        w = tl.sum(tl.where(flat_expert == best, flat_scores, 0.0))  # the unbiased score of the chosen expert
        weights = tl.where(slots == k, w, weights)
        ids = tl.where(slots == k, best.to(tl.int64), ids)
        flat_choice = tl.where(flat_expert == best, float("-inf"), flat_choice)
    if NORMALIZE:
        weights = tl.math.div_rn(weights, tl.sum(weights) + 1e-20)
    weights = weights * scaling
    out = slots < TOP_K
    tl.store(w_ptr + t * TOP_K + slots, weights, mask=out)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=out)


def fused_select_experts(router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor],
                         cfg: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `moe.select_experts`: (T, E) logits -> (weights (T, k) fp32, ids (T, k) int64).

    Runs the Triton kernel on CUDA tensors (and on the CPU under TRITON_INTERPRET=1); the torch reference on
    plain CPU tensors."""
    if not router_logits.is_cuda and not interpreter_requested():
        return select_experts(router_logits, correction_bias, cfg)
    tokens, num_experts = router_logits.shape
    grouped = cfg.topk_method != "greedy"
    n_group = cfg.n_group if grouped else 1
    if num_experts % n_group:
        raise ValueError(f"n_group={n_group} does not divide the {num_experts} experts")
    per_group = num_experts // n_group
    weights = torch.empty(tokens, cfg.top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, cfg.top_k, dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    bias = correction_bias if grouped and correction_bias is not None else None
    _routing_kernel[(tokens,)](
        logits, bias if bias is not None else logits, weights, ids, logits.stride(0), num_experts,
        float(cfg.routed_scaling_factor),
        N_GROUP=n_group, PER_GROUP=per_group, G_P=next_pow2(n_group),
        PG_P=next_pow2(per_group), TOP_K=cfg.top_k, TOPK_P=next_pow2(cfg.top_k),
        TOPK_GROUP=cfg.topk_group if grouped else 0, SIGMOID=cfg.scoring_func == "sigmoid",
        HAS_BIAS=bias is not None, GROUPED=grouped, GROUP_TOP2=cfg.topk_method == "noaux_tc",
        MASK_NEG_INF=cfg.topk_method == "noaux_tc", NORMALIZE=cfg.norm_topk_prob and cfg.top_k > 1,
        num_warps=4 if num_experts >= 128 else 1)
    return weights, ids

