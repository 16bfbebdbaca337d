"""MoE routing and expert computation behind a backend registry.

Expert weights are stacked: w13 (E, 2I, H) = [gate; up] and w2 (E, H, I), optionally block-FP8 with scales
(E, 2I/bn, ceil(H/bk)) and (E, ceil(H/bn), I/bk). Routing follows DeepSeek-V3 (sigmoid + correction bias,
group-limited) or V2 (softmax, greedy or group-limited).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .gemm import FP8_DTYPE, block_dequant
from pdserve.common.registry import Registry


@dataclass(frozen=True)
class RoutingConfig:
    top_k: int
    scoring_func: str  # "sigmoid" | "softmax"
    topk_method: str  # "noaux_tc" | "greedy" | "group_limited_greedy"
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def select_experts(router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor],
                   cfg: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) fp32 -> (weights (T, top_k) fp32, expert ids (T, top_k) int64)."""
    tokens, num_experts = router_logits.shape
    if cfg.scoring_func == "sigmoid":
        scores = router_logits.sigmoid()  # (T, E)
    else:
        scores = router_logits.softmax(dim=-1)
    if cfg.topk_method == "greedy":
        weights, ids = torch.topk(scores, cfg.top_k, dim=-1, sorted=False)
    else:
        # Selection uses biased scores (V3's aux-loss-free balancing); the weights use the unbiased ones.
        choice = scores + correction_bias if correction_bias is not None else scores  # (T, E)
        grouped = choice.view(tokens, cfg.n_group, num_experts // cfg.n_group)  # (T, G, E/G)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, G): sum of the top-2 in each group
        else:
            group_scores = grouped.max(dim=-1).values  # V2 group_limited_greedy: best expert per group
        group_idx = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False)[1]  # (T, topk_group)
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()  # (T, G)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(tokens, num_experts)
        # V2 masks with 0 (its scores are softmax probabilities, all > 0); V3 with -inf.
        fill = float("-inf") if cfg.topk_method == "noaux_tc" else 0.0
        ids = torch.topk(choice.masked_fill(~expert_mask, fill), cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)  # (T, top_k)
    if cfg.norm_topk_prob and cfg.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class MoEBackend(ABC):
    # True when the ops never synchronise with the host, so CUDA graphs can capture them.
    graph_safe: bool = False

    def select_experts(self, router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor],
                       cfg: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing; backends may fuse it. Same contract as the module-level select_experts."""
        return select_experts(router_logits, correction_bias, cfg)

    @abstractmethod
    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor],
                block: Optional[tuple[int, int]], absent: bool = False) -> torch.Tensor:
        """x (T, H); topk_* (T, k); returns sum_k weight_k * expert_k(x) as (T, H) in x's dtype.

        absent: topk_ids may hold E = w13.shape[0], a pair whose expert lives on another rank (expert parallelism):
        it adds nothing here and costs no expert computation (its weight is 0 too)."""


MOE_BACKENDS: Registry[type[MoEBackend]] = Registry("moe")


@MOE_BACKENDS.register("torch")
class TorchMoE(MoEBackend):
    """Reference: gather the tokens of each expert, SiLU-and-mul, scatter-add weighted outputs."""

    def experts(self, x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, block, absent=False):
        out = torch.zeros_like(x)
        inter = w2.shape[-1]
        for e in torch.unique(topk_ids).tolist():
            if e >= w13.shape[0]:
                continue  # another rank's expert (absent)
            token_idx, slot = torch.where(topk_ids == e)  # tokens routed to e, and which of their k slots
            w13_e, w2_e = w13[e], w2[e]
            if w13_e.dtype == FP8_DTYPE:
                w13_e = block_dequant(w13_e, w13_scale[e], block, x.dtype)
                w2_e = block_dequant(w2_e, w2_scale[e], block, x.dtype)
            gate_up = F.linear(x[token_idx], w13_e)  # (n, 2I)
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # (n, I)
            y = F.linear(h, w2_e) * topk_weights[token_idx, slot, None].to(x.dtype)  # (n, H)
            out.index_add_(0, token_idx, y)
        return out
