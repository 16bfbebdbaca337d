"""The fused RMSNorm and RoPE kernels compiled on a GPU: against the torch references at DeepSeek-V3 and demo-model
widths, in bf16 and fp32, and replayed from a CUDA graph after their inputs change in place."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.norm_rope import apply_rope, apply_rope_reference, rms_norm, rms_norm_reference
from pdserve.kernels.triton_support import triton_installed
from norm_rope_checks import check_rms_norm, check_rope, norm_case, rope_case, rope_error

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or not triton_installed():
    pytest.skip("needs a CUDA GPU and triton", allow_module_level=True)

from pdserve.kernels import triton_norm_rope as fused  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,dim", [(1, 7168), (37, 1536), (5, 512), (128, 256), (3, 64)])
def test_rms_norm(rows, dim, dtype):
    # bf16: at most one rounding step from the reference; fp32: last bits of the sum order and rsqrt
    assert check_rms_norm(fused, rows, dim, dtype, "cuda", seed=rows) <= (1 if dtype == torch.bfloat16 else 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 128, 64), (33, 16, 64), (7, 1, 64), (4, 4, 16)])
def test_rope(tokens, heads, dim, interleave, dtype):
    # a rounding step or two of the row's scale (bf16 products and sums; fp32 mul-add contraction)
    assert check_rope(fused, tokens, heads, dim, dtype, "cuda", interleave, seed=tokens) <= (
        2 if dtype == torch.bfloat16 else 64)


def test_dispatch_and_graph_replay():
    """CUDA tensors take the kernels (unless PDSERVE_TORCH_NORM_ROPE=1); a captured graph replays them on new
    inputs written in place."""
    x, w = norm_case(8, 512, torch.bfloat16, "cuda", 1, strided=True)
    q, cos, sin = rope_case(8, 16, 64, torch.bfloat16, "cuda", 2)
    rms_norm(x, w, 1e-6), apply_rope(q, cos, sin, True)  # warm up (compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed = rms_norm(x, w, 1e-6)
        roped = apply_rope(q, cos, sin, True)
    x.copy_(norm_case(8, 512, torch.bfloat16, "cuda", 3, strided=True)[0])
    q.copy_(rope_case(8, 16, 64, torch.bfloat16, "cuda", 4)[0])
    graph.replay()
    torch.cuda.synchronize()
    ref_norm = rms_norm_reference(x, w, 1e-6)
    assert ((normed.float() - ref_norm.float()).abs() / ref_norm.float().abs().clamp(min=1e-3)).max() <= 2 ** -7
    assert rope_error(roped, apply_rope_reference(q, cos, sin, True)) <= 2 * 2 ** -7
