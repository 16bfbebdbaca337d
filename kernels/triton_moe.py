"""The "triton" MoE backend: fused-MoE Triton kernels over the aligned token layout (triton_moe_kernels.py),
fused routing (triton_routing.py), tile configs tuned per shape and device (moe_configs.py).

Registered whenever the triton package is installed (this module itself does not import triton: see
triton_support.py); usable on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1 for tests.
"""

from __future__ import annotations

from typing import Optional

from .gemm import FP8_DTYPE
from .moe import MOE_BACKENDS, MoEBackend
from .moe_configs import device_name
from .triton_support import interpreter_requested, triton_installed


class TritonMoE(MoEBackend):
    """Block-FP8 (128x128) or bf16/fp16/fp32 experts; no host syncs, so CUDA graphs can capture it."""

    graph_safe = True

    def __init__(self):
        # NOTE: kernel modules import triton, so they are imported here, not at module import (triton_support.py).
        from . import triton_moe_kernels, triton_routing

        self._kernels, self._routing = triton_moe_kernels, triton_routing
        self._device_name: Optional[str] = None

    def experts(self, x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, block, absent=False):
        if not x.is_cuda and not interpreter_requested():
            raise ValueError(f"the triton MoE backend needs CUDA tensors, got {x.device}; use --moe-backend torch "
                             "on the CPU (or TRITON_INTERPRET=1 before triton is first imported, for tests)")
        if w13.dtype == FP8_DTYPE and tuple(block or ()) != (128, 128):
            raise ValueError(f"the triton MoE backend takes 128x128 FP8 blocks, got {block}")
        if self._device_name is None:
            self._device_name = device_name(x.device) if x.is_cuda else "cpu"
        return self._kernels.fused_experts(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale,
                                           device=self._device_name, absent=absent)

    def select_experts(self, router_logits, correction_bias, cfg):
        """Fused routing (one kernel per layer), same contract as moe.select_experts."""
        return self._routing.fused_select_experts(router_logits, correction_bias, cfg)


if triton_installed():
    MOE_BACKENDS.register("triton")(TritonMoE)
