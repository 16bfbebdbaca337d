"""The installed DeepGEMM build: whether it runs here (checked once per process, in a child process) and its FP8
GEMMs under the names that build gives them. Shared by the "deep_gemm" MoE backend (deep_gemm_moe.py) and dense
GEMM backend (deep_gemm_dense.py). Imports neither deep_gemm nor triton at module import.

Builds (FACTS §2): verified is SGLang's `sgl-deep-gemm==0.1.4.post1` on torch 2.11 + CUDA 13 (Hopper). Its compiled
`_C.so` links libtorch and libcudart.so.13, so it loads only under a torch of that build; later sgl-deep-gemm
releases (0.2.x) are built for a newer torch and fail to load under 2.11. Upstream `deep-gemm` 2.x uses the same
names except for the masked GEMM; 1.x names are accepted as a fallback (not run here).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import subprocess
import sys
from typing import Callable, Optional

import torch

# The names builds give each op, this build's first: sgl-deep-gemm 0.1.4.post1, upstream 2.x, upstream 1.x.
OP_NAMES = {
    "gemm": ("fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt"),
    "contiguous": ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"),
    "masked": ("fp8_m_grouped_gemm_nt_masked", "m_grouped_fp8_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked"),
}
DISTRIBUTIONS = ("sgl-deep-gemm", "deep-gemm", "deep_gemm")  # packages that install the `deep_gemm` module
# The torch each known build's compiled extension was built against (and so needs).
PINNED_BUILD = "sgl-deep-gemm 0.1.4.post1"
BUILT_FOR = {PINNED_BUILD: "torch 2.11 with CUDA 13 (2.11.0+cu130)"}
PINNED = "sgl-deep-gemm==0.1.4.post1"  # what `pip install 'pdserve[gpu]'` installs (pyproject.toml)


def installed() -> bool:
    """`import deep_gemm` would find a package (checked without importing it)."""
    return importlib.util.find_spec("deep_gemm") is not None


def installed_build() -> str:
    """'sgl-deep-gemm 0.1.4.post1', or what is known of the package that provides `deep_gemm`."""
    for dist in DISTRIBUTIONS:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "deep_gemm (no package metadata)"


def find_op(module, op: str) -> Callable:
    """The function `module` (deep_gemm, or a stand-in with the same names) offers for `op` ("gemm", "contiguous",
    "masked"), under the first of its known names that it has."""
    for name in OP_NAMES[op]:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"deep_gemm has none of {', '.join(OP_NAMES[op])} (supported builds: {PINNED} and "
                       "upstream deep-gemm 1.x/2.x names)")


# Run in a child process: imports deep_gemm, finds every op, and checks one small GEMM with random scales against
# torch (so a scale-layout change in a new build fails here, not in the model). Exit codes say which step failed.
_PROBE = r"""
import sys, torch
try:
    import deep_gemm
except BaseException as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(3)
names = %r
missing = [op for op, alts in names.items() if not any(hasattr(deep_gemm, n) for n in alts)]
if missing:
    print("missing ops: " + "; ".join(" or ".join(names[op]) for op in missing), file=sys.stderr)
    sys.exit(4)
gemm = next(getattr(deep_gemm, n) for n in names["gemm"] if hasattr(deep_gemm, n))
m, n, k = 128, 256, 384
a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
sa, sb = torch.rand(m, k // 128, device="cuda") + 0.5, torch.rand(n // 128, k // 128, device="cuda") + 0.5
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
gemm((a, sa), (b, sb), d)
ref = (a.float() * sa.repeat_interleave(128, 1)) @ (b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)).T
err = ((d.float() - ref).abs().max() / ref.abs().max()).item()
if not err < 2e-2:
    print(f"fp8 GEMM with random scales is off by {err:.2e} of max|ref|", file=sys.stderr)
    sys.exit(5)
"""


def explain_probe_failure(returncode: int, stderr: str, build: str, torch_version: str) -> str:
    """A plain reason from the probe child's exit code and stderr."""
    last = stderr.strip().splitlines()[-1] if stderr.strip() else "(no output)"
    needs = BUILT_FOR.get(build)
    if returncode == 3 or returncode < 0:
        how = "does not load" if returncode == 3 else f"crashed (signal {-returncode}) at import or first GEMM"
        if needs:
            wants = f"it is built for {needs}"
        else:
            wants = f"each build is compiled against one torch; {PINNED} is the one for {BUILT_FOR[PINNED_BUILD]}"
        return f"{build} {how} with this torch ({torch_version}): {wants}. Install the build made for this torch. ({last})"
    if returncode == 4:
        return f"{build} lacks the ops pdserve calls: {last}"
    if returncode == 5:
        return f"{build} loads but computes wrong results here: {last}"
    return f"{build} failed in a child process (exit {returncode}): {stderr.strip()[-1500:]}"


@functools.cache
def unusable_reason(timeout_s: float = 600.0) -> Optional[str]:
    """None if deep_gemm imports, has every op, and computes one FP8 GEMM right on this machine's GPU; else why
    not. Cached per process (tests fake it with monkeypatch).

    NOTE: DeepGEMM builds made for another torch fail to load or segfault at import or first call (FACTS §2); a
    segfault cannot be caught in-process, so the first contact happens in a child. The first call JIT-compiles a
    kernel with nvcc (cached on disk afterwards), hence the long timeout."""
    if not installed():
        return f"the deep_gemm package is not installed (pip install 'pdserve[gpu]' installs {PINNED})"
    if not torch.cuda.is_available():
        return "no CUDA GPU here"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"DeepGEMM's FP8 kernels need Hopper (sm_90) or newer; this GPU is sm_{major}{minor}"
    build = installed_build()
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE % (OP_NAMES,)], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"{build}: importing it and running one GEMM took more than {timeout_s:.0f} s"
    if proc.returncode != 0:
        return explain_probe_failure(proc.returncode, proc.stderr, build, torch.__version__)
    return None


def require_usable() -> None:
    """RuntimeError with the reason unless deep_gemm runs here (call before importing deep_gemm in-process)."""
    reason = unusable_reason()
    if reason is not None:
        raise RuntimeError(f"deep_gemm cannot run here: {reason}")
