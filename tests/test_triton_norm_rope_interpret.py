"""The fused RMSNorm and RoPE kernels against the torch references, on the CPU under Triton's interpreter
(tests/interpreter_mode.py sets TRITON_INTERPRET at collection)."""

from __future__ import annotations

import pytest
import torch

from interpreter_mode import enter_interpreter

rerun = enter_interpreter(__file__, "tests/test_gpu_norm_rope.py")
if rerun is not None:
    test_interpreted_in_a_fresh_process = rerun
else:
    from norm_rope_checks import check_rms_norm, check_rope
    from pdserve.kernels import triton_norm_rope as fused

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("rows,dim,strided", [(1, 32, False), (5, 48, True), (3, 256, True)])
    def test_rms_norm_matches_reference(rows, dim, strided, dtype):
        # fp32: the sum order and rsqrt differ in the last bits; fp16: at most one rounding step apart
        assert check_rms_norm(fused, rows, dim, dtype, "cpu", strided=strided) <= (64 if dtype == torch.float32 else 1)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("interleave", [True, False])
    @pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 8), (4, 3, 16), (2, 5, 64)])
    def test_rope_matches_reference(tokens, heads, dim, interleave, dtype):
        # every product and sum is rounded to dtype as in the reference: the interpreter matches it exactly
        assert check_rope(fused, tokens, heads, dim, dtype, "cpu", interleave) == 0.0

    def test_empty_inputs():
        x = torch.empty(0, 3, 16)
        cos = sin = torch.empty(0, 8)
        assert fused.apply_rope(x, cos, sin, True).shape == (0, 3, 16)
        assert fused.rms_norm(torch.empty(0, 32), torch.ones(32), 1e-6).shape == (0, 32)
