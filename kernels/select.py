"""Choosing kernel backends for a device: `auto` picks the fastest one installed, and an explicit choice is checked
against what the machine has, with an error that says what is missing."""

from __future__ import annotations

from .attention import ATTENTION_BACKENDS
from .gemm import GEMM_BACKENDS
from .moe import MOE_BACKENDS

# Fastest first; the torch references always exist.
PREFERENCE = {"attention": ("flashinfer", "triton", "torch"), "moe": ("deep_gemm", "triton", "torch"),
              "gemm": ("triton", "torch")}
REGISTRIES = {"attention": ATTENTION_BACKENDS, "moe": MOE_BACKENDS, "gemm": GEMM_BACKENDS}
GPU_ONLY = {"flashinfer", "triton", "deep_gemm"}


def resolve(kind: str, name: str, device: str) -> str:
    registry = REGISTRIES[kind]
    on_gpu = str(device).startswith("cuda")
    if name == "auto":
        if not on_gpu:
            return "torch"
        return next(n for n in PREFERENCE[kind] if n in registry)
    if name not in registry:
        raise ValueError(f"--{kind}-backend {name}: not available on this machine (its package is not installed); "
                         f"available: {', '.join(registry.names())}")
    if name in GPU_ONLY and not on_gpu:
        raise ValueError(f"--{kind}-backend {name} needs a CUDA GPU but the device is {device}; "
                         "use torch on the CPU")
    return name


def resolve_backends(attention: str, moe: str, device: str) -> tuple[str, str, str]:
    gemm = "auto" if moe == "auto" else ("triton" if moe in GPU_ONLY and "triton" in GEMM_BACKENDS else "torch")
    return resolve("attention", attention, device), resolve("moe", moe, device), resolve("gemm", gemm, device)
