"""What our Triton kernels share, without importing triton.

NOTE: the kernel modules (triton_mla_decode, triton_ragged_prefill) import triton and are imported lazily, on first
use. Triton decides at import time whether kernels (its own tl.zeros / tl.sum included) run compiled or under its
CPU interpreter (TRITON_INTERPRET=1). Importing `pdserve.kernels` must therefore not import triton, or a CPU test
module could no longer turn the interpreter on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Iterator

import torch


def triton_installed() -> bool:
    """`import triton` would find a package (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU under Triton's interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(t: torch.Tensor) -> None:
    """Refuse CPU tensors unless the interpreter is on: a compiled Triton kernel would fail obscurely on them."""
    if t.device.type != "cuda" and not interpreter_requested():
        raise ValueError(f"the triton attention backend needs CUDA tensors, got {t.device}; to run its kernels on "
                         "the CPU (tests only) set TRITON_INTERPRET=1 before triton is first imported")


@functools.lru_cache(maxsize=None)
def patch_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(1-element array), which numpy >= 2.4
    refuses ("only 0-dimensional arrays can be converted"): every `range(start, end)` over runtime values fails.
    Called by the kernel modules only when the interpreter is on; compiled kernels never see it."""
    import triton.runtime.interpreter as interp

    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:  # a Triton whose interpreter is organised differently: nothing to fix here
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interp._patch_lang_tensor = patched


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a host-side query, cached; safe during graph capture).

    Off the GPU (interpreter) a small stand-in, so the split heuristic still makes several splits in tests.
    """
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@contextlib.contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """Inside: the list of Triton kernel variants this process compiles (or loads from the on-disk cache), one
    `name[options](signature)` entry each. What a warm-up promises: once it ran, no request compiles anything.

    Triton 3.4+ calls `triton.knobs.runtime.jit_post_compile_hook` for each new variant (older: the class attribute
    `JITFunction.compiled_hook`); a hook already set is called too and put back after."""
    import triton
    from triton.runtime.jit import JITFunction

    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None and hasattr(knobs, "jit_post_compile_hook"):
        owner, attr = knobs, "jit_post_compile_hook"
    elif hasattr(JITFunction, "compiled_hook"):
        owner, attr = JITFunction, "compiled_hook"
    else:
        raise RuntimeError(f"triton {triton.__version__} has no post-compile hook to count compiles with")
    seen: list[str] = []
    previous = getattr(owner, attr)

    def hook(*args, **kwargs):
        seen.append(str(kwargs.get("repr") or kwargs.get("fn") or args))
        return previous(*args, **kwargs) if previous is not None else None

    setattr(owner, attr, hook)
    try:
        yield seen
    finally:
        setattr(owner, attr, previous)
