"""The Gluon grouped GEMM (kernels/gluon_grouped_gemm.py) compiled for Hopper (sm_90) on the CPU, without a GPU.

Gluon has no CPU interpreter, so its numbers are checked on the GPU (tests/test_gpu_moe_gemm.py). What the CPU can
check is the property the kernel exists for: a K step's promotion overlaps the next step's wgmma, i.e. the PTX
waits with one wgmma group still in flight, and ptxas neither spills nor serializes the wgmmas (warning C7514: a
loop that copies a product still being written makes ptxas serialize every wgmma, which silently undoes the
overlap; the kernel's two-step unrolled loop avoids it). The ptxas check runs where a ptxas that reads this
Triton's PTX ships with it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                or importlib.util.find_spec("triton.experimental.gluon") is None,
                                reason="needs a Triton with Gluon")


def compile_for_sm90(kernel, args, kwargs):
    """triton.compile of a JIT (or Gluon) kernel for sm_90 with these launch arguments, as its launcher would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    from triton.experimental.gluon._runtime import GluonASTSource

    return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def ptxas_report(ptx: str, tmp_path) -> str | None:
    """`ptxas -v` of the PTX for sm_90a with a ptxas bundled with Triton that reads it, or None."""
    import triton

    path = tmp_path / "kernel.ptx"
    path.write_text(ptx)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas", "ptxas-blackwell"):
        exe = os.path.join(bin_dir, name)
        if os.path.exists(exe):
            proc = subprocess.run([exe, "-v", "--gpu-name", "sm_90a", str(path), "-o", os.devnull],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                return proc.stderr
    return None


@pytest.mark.parametrize("block_m", [64, 128])
def test_gluon_grouped_gemm_overlaps_promotion_without_serializing(block_m, tmp_path):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from pdserve.kernels import gluon_grouped_gemm as gg

    fp8 = torch.float8_e4m3fn
    rows, n, k, groups = 1024, 4096, 7168, 4  # V3 gate-up (CPU tensors: only shapes, strides, alignment matter)
    a, b = torch.empty(rows, k, dtype=fp8), torch.empty(groups * n, k, dtype=fp8)
    sa, sb = torch.empty(rows, k // 128), torch.empty(groups, n // 128, k // 128)
    d, m_indices = torch.empty(rows, n, dtype=torch.bfloat16), torch.empty(rows, dtype=torch.int32)
    a_desc = TensorDescriptor.from_tensor(a, [block_m, 128], gl.NVMMASharedLayout.get_default_for([block_m, 128],
                                                                                                  gl.float8e4nv))
    b_desc = TensorDescriptor.from_tensor(b, [128, 128], gl.NVMMASharedLayout.get_default_for([128, 128],
                                                                                             gl.float8e4nv))
    cfg = gg.default_gluon_config(block_m)
    compiled = compile_for_sm90(gg._gluon_grouped_fp8_kernel,
                                (a_desc, sa, b_desc, sb, d, m_indices, rows, n, k, sa.stride(0), sa.stride(1),
                                 sb.stride(0), sb.stride(1), sb.stride(2), d.stride(0)),
                                dict(cfg, BLOCK_M=block_m))
    ptx = compiled.asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1;" in ptx, "no promotion runs under a wgmma in flight"
    report = ptxas_report(ptx, tmp_path)
    if report is None:
        pytest.skip("no ptxas bundled with this Triton reads its PTX")
    assert "C7514" not in report, f"ptxas serializes the wgmmas:\n{report}"
    assert " 0 bytes spill stores" in report, report
