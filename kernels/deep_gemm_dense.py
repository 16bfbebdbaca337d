"""The "deep_gemm" dense GEMM backend: block-FP8 linears (attention projections, dense MLP, shared expert) on
DeepGEMM's `fp8_gemm_nt` (FACTS §2), next to "scaled_mm" and "triton" (triton_gemm.py).

y = (x_q * x_scale) @ (W_q * W_scale)^T: activations quantized per token per 128 channels by our Triton kernel,
fp32 scales written MN-major with M padded to 4 (DeepGEMM's TMA-aligned layout on sm_90: given row-major scales it
copies them into it, an extra kernel per GEMM), weights and their (ceil(N/128), K/128)
fp32 scales as the checkpoint stores them. Shapes DeepGEMM does not take (K not a multiple of
128, N not a multiple of 8, outputs other than bf16), fewer than MIN_ROWS rows (slower or no faster there)
and non-FP8 weights go to the scaled_mm / Triton path.

Registered wherever the deep_gemm package is installed; whether it runs here is checked in a child process
(deep_gemm_ops.py). Nothing syncs with the host, so CUDA graphs capture it (DeepGEMM JIT-compiles a kernel per
shape class on first use: the warm-up before capture does that).
"""

from __future__ import annotations

import torch

from . import deep_gemm_ops
from .gemm import FP8_DTYPE, GEMM_BACKENDS
from .triton_gemm import TritonGemm, scaled_mm_blockwise_available

GROUP = 128
# DeepGEMM from this many rows up; fewer go to scaled_mm (cuBLAS). From 4096 rows DeepGEMM is ahead of scaled_mm on
# most V3 shapes and the long prefills are faster with it; at 2048 rows (the engine's default prefill chunk) it is
# slower on the narrow projections (q_a, kv_a), and under decode's CUDA graphs it gains nothing (see
# benchmarks/results/README.md, `moe` / DeepGEMM).
MIN_ROWS = 4096


class DeepGemmGemm(TritonGemm):
    """Block-FP8 (128x128) weights on DeepGEMM's `fp8_gemm_nt` from min_rows rows up; the rest as the scaled_mm (or
    triton) backend.

    ops: the `deep_gemm` module by default (imported only once a child process ran it), or a stand-in with an
    `fp8_gemm_nt` (grouped_contract.dense_reference)."""

    graph_safe = True

    def __init__(self, ops=None, min_rows: int = MIN_ROWS):
        super().__init__(use_scaled_mm=scaled_mm_blockwise_available())
        if ops is None:
            deep_gemm_ops.require_usable()
            import deep_gemm

            ops = deep_gemm
        self._gemm = deep_gemm_ops.find_op(ops, "gemm")
        self.min_rows = min_rows

    def takes(self, x: torch.Tensor, weight: torch.Tensor, block) -> bool:
        """Whether DeepGEMM runs this linear (else the scaled_mm / Triton path does)."""
        n, k = weight.shape
        return (weight.dtype == FP8_DTYPE and tuple(block or ()) == (GROUP, GROUP) and x.dtype == torch.bfloat16
                and k % GROUP == 0 and n % 8 == 0 and x.numel() // k >= self.min_rows)

    def linear(self, x, weight, scale_inv, block):
        if not self.takes(x, weight, block):
            return super().linear(x, weight, scale_inv, block)
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        # Scales MN-major with M padded to 4 (strides (1, M')): DeepGEMM's own sm_90 layout, so it need not copy.
        xq, xs = self._fp8.per_token_group_quant(x2, column_major_scales=True, pad_rows_to=4)
        y = torch.empty(m, weight.shape[0], dtype=torch.bfloat16, device=x.device)
        self._gemm((xq[:m], xs[:m]), (weight, scale_inv), y)
        return y.view(*lead, weight.shape[0])


if deep_gemm_ops.installed():
    GEMM_BACKENDS.register("deep_gemm")(DeepGemmGemm)
