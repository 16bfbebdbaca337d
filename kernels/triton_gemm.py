"""Dense GEMM backends for block-FP8 weights: "triton" (our Triton kernels, triton_fp8.py) and "scaled_mm"
(torch's blockwise `scaled_mm`, i.e. cuBLAS, where torch has it). Plain bf16/fp16/fp32 weights go to torch
(F.linear: cuBLAS is the ceiling there).

FP8 path: activations quantized per token per 128 channels (Triton kernel), then
y = (x_q * x_scale) @ (W_q * W_scale)^T with fp32 accumulation, written in x's dtype. Nothing syncs with the host,
so both backends can be captured in CUDA graphs. (The scaled_mm backend learns on its first call of a shape with
(K/128) % 4 != 0 whether this torch takes the padded scale layout; the warm-up pass, before capture, does that.)

Registered whenever the triton package is installed (this module itself does not import triton: see
triton_support.py); "scaled_mm" also needs torch.nn.functional.scaled_mm with blockwise scaling.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from .gemm import FP8_DTYPE, GEMM_BACKENDS, GemmBackend
from .triton_support import triton_installed

GROUP = 128
# Up to this many rows (decode's batches) the Triton kernel runs even where scaled_mm is on: under CUDA graphs its
# small-M tiles (narrow N tiles, split-K) beat cuBLAS's blockwise kernels on every V3 projection
# (benchmarks/results/h200/checks/decode_linear/).
TRITON_MAX_ROWS = 16


def scaled_mm_blockwise_available() -> bool:
    """True where torch has F.scaled_mm with BlockWise1x128 / BlockWise128x128 recipes."""
    scaling = getattr(F, "ScalingType", None)
    return (hasattr(F, "scaled_mm") and scaling is not None and hasattr(scaling, "BlockWise1x128")
            and hasattr(scaling, "BlockWise128x128"))


def scaled_mm_weight_scale(scale_inv: torch.Tensor) -> torch.Tensor:
    """(N/128, K/128) -> the (K/128, N/128) view cuBLAS takes: K-block stride 1, N-block stride K/128 rounded up
    to 4 (newer torch checks for that padding; it is where older torch read out of bounds when (K/128) % 4 != 0)."""
    nb, kb = scale_inv.shape
    kb4 = -(-kb // 4) * 4
    if kb4 == kb and scale_inv.is_contiguous():
        return scale_inv.t()
    padded = scale_inv.new_zeros(nb, kb4)
    padded[:, :kb] = scale_inv
    return padded[:, :kb].t()


class TritonGemm(GemmBackend):
    """Block-FP8 weights: Triton per-token-group quantization + Triton block-scaled GEMM; other weights: torch.

    use_scaled_mm=True routes FP8 GEMMs of more than TRITON_MAX_ROWS rows through torch's blockwise `scaled_mm`
    (cuBLAS) where it takes the shape, the Triton kernel elsewhere (the "scaled_mm" registry name is this with
    use_scaled_mm=True)."""

    graph_safe = True

    def __init__(self, use_scaled_mm: bool = False):
        if use_scaled_mm and not scaled_mm_blockwise_available():
            raise ValueError("use_scaled_mm=True needs torch.nn.functional.scaled_mm with blockwise scaling "
                             "(torch >= 2.10); use the triton GEMM backend instead")
        # NOTE: the kernel module imports triton, so it is imported here, not at module import (triton_support.py).
        from . import triton_fp8

        self._fp8 = triton_fp8
        self.use_scaled_mm = use_scaled_mm
        # Per weight scale tensor, the padded transposed copy cuBLAS wants (weights are fixed after loading).
        # NOTE: keyed by storage address and shape, not by the tensor: tensor keys compare with ==, which is
        # elementwise and raises inside dict lookups.
        self._scale_cache: dict[tuple, torch.Tensor] = {}
        # Set when torch refused the padded scale layout for a (K/128) % 4 != 0 shape (older torch).
        self._ragged_kb_refused = False

    def linear(self, x, weight, scale_inv, block):
        if weight.dtype != FP8_DTYPE:
            return F.linear(x, weight.to(x.dtype) if weight.dtype != x.dtype else weight)
        assert scale_inv is not None and tuple(block or ()) == (GROUP, GROUP), \
            f"the triton GEMM takes 128x128 FP8 blocks, got {block}"
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        n = weight.shape[0]
        ragged_kb = (k // GROUP) % 4 != 0
        if (self.use_scaled_mm and x2.shape[0] > TRITON_MAX_ROWS and k % GROUP == 0 and n % GROUP == 0
                and not (ragged_kb and self._ragged_kb_refused)):
            y = self._scaled_mm(x2, weight, scale_inv, out_dtype, ragged_kb)
        else:
            y = None
        if y is None:
            xq, xs = self._fp8.per_token_group_quant(x2)
            y = self._fp8.block_fp8_matmul(xq, xs, weight, scale_inv, out_dtype)
        return y.view(*lead, n)

    def _scaled_mm(self, x2, weight, scale_inv, out_dtype, ragged_kb):
        """cuBLAS blockwise FP8 GEMM, or None where this torch refuses the shape (the caller falls back)."""
        key = (scale_inv.data_ptr(), tuple(scale_inv.shape), scale_inv.device)
        sb = self._scale_cache.get(key)
        if sb is None:
            sb = self._scale_cache[key] = scaled_mm_weight_scale(scale_inv)
        # cuBLAS wants the activation scales M-major with M a multiple of 4: padding rows are quantized zeros.
        xq, xs = self._fp8.per_token_group_quant(x2, column_major_scales=True, pad_rows_to=4)
        try:
            y = F.scaled_mm(xq, weight.t(), xs, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                            output_dtype=out_dtype)
        except (RuntimeError, ValueError):  # torch reports layout refusals as either
            if not ragged_kb:
                raise
            # NOTE: older torch rejects the padded scale layout and silently misreads the unpadded one when
            # (K/128) % 4 != 0, so those shapes go to the Triton kernel instead.
            self._ragged_kb_refused = True
            return None
        return y[:x2.shape[0]]


class ScaledMMGemm(TritonGemm):
    """torch blockwise `scaled_mm` (cuBLAS) for block-FP8 weights, the Triton kernel where it cannot."""

    def __init__(self):
        super().__init__(use_scaled_mm=True)


if triton_installed():
    GEMM_BACKENDS.register("triton")(TritonGemm)
    if scaled_mm_blockwise_available():
        GEMM_BACKENDS.register("scaled_mm")(ScaledMMGemm)
