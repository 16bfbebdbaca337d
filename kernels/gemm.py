"""Dense GEMMs, including DeepSeek-V3's block-wise FP8 format, behind a backend registry.

FP8 layout (FACTS §5): `weight` float8_e4m3fn (N, K) and `weight_scale_inv` fp32 (ceil(N/bn), ceil(K/bk)), one per
block; the real value of a weight is fp8 * scale_inv of its block. Activations are quantized per token per 128
channels at run time on the GPU paths; the torch reference dequantizes the weight and keeps activations as they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from pdserve.common.registry import Registry

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INV_FP8_MAX = 1.0 / FP8_MAX  # activation scales are amax * this (see per_token_group_quant)


def block_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(…, N, K) fp8 weight and (…, ceil(N/bn), ceil(K/bk)) scales -> (…, N, K) dequantized weight."""
    bn, bk = block
    n, k = weight.shape[-2:]
    scale = scale_inv.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]  # (…, N, K)
    return (weight.to(torch.float32) * scale).to(dtype)


def block_quant(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(…, N, K) float weight -> fp8 weight and fp32 scale_inv per (bn, bk) block (edge blocks zero-padded)."""
    bn, bk = block
    *lead, n, k = weight.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = weight.new_zeros(*lead, nb * bn, kb * bk, dtype=torch.float32)
    padded[..., :n, :k] = weight.float()
    blocks = padded.view(*lead, nb, bn, kb, bk)  # (…, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # (…, nb, kb)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale_inv.contiguous()


def per_token_group_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) activations -> fp8 (M, K) and fp32 scales (M, ceil(K/group)), one per token per channel group."""
    m, k = x.shape
    g = -(-k // group)
    padded = x.new_zeros(m, g * group, dtype=torch.float32)
    padded[:, :k] = x.float()
    groups = padded.view(m, g, group)
    # NOTE: times the fp32 reciprocal, not `/ FP8_MAX`: torch on CUDA turns division by a Python scalar into that
    # multiply while the CPU divides, so only this form gives the same scales on every device and in the kernel.
    scale = groups.abs().amax(-1).clamp(min=1e-12) * INV_FP8_MAX  # (M, G)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, g * group)[:, :k].contiguous(), scale


class GemmBackend(ABC):
    """y = x @ W^T for a plain or block-FP8 weight."""
    # True when the ops never synchronise with the host, so CUDA graphs can capture them.
    graph_safe: bool = False


    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale_inv: Optional[torch.Tensor],
               block: Optional[tuple[int, int]]) -> torch.Tensor:
        """x (…, K) in the activation dtype; weight (N, K) float or fp8 (+ scale_inv, block); returns (…, N)."""


GEMM_BACKENDS: Registry[type[GemmBackend]] = Registry("gemm")


@GEMM_BACKENDS.register("torch")
class TorchGemm(GemmBackend):
    graph_safe = True  # block_dequant and F.linear have static shapes
    def linear(self, x, weight, scale_inv, block):
        if weight.dtype == FP8_DTYPE:
            assert scale_inv is not None and block is not None, "fp8 weight without its block scales"
            weight = block_dequant(weight, scale_inv, block, x.dtype)
        return torch.nn.functional.linear(x, weight)
