"""Which kernel backends this machine can run, and an error that says what is missing for one it cannot.

Registration (pdserve/common/registry.py) says a backend's package is there; availability adds the device it needs
and, for deep_gemm, that the installed build runs on it (a child process checks once: deep_gemm_ops.py).
"""

from __future__ import annotations

import importlib.util

import torch

from . import deep_gemm_ops, flashinfer_attention, triton_attention  # noqa: F401  (register what is installed)
from .attention import ATTENTION_BACKENDS
from .gemm import GEMM_BACKENDS
from .moe import MOE_BACKENDS
from .triton_support import interpreter_requested, triton_installed

REGISTRIES = {"attention": ATTENTION_BACKENDS, "moe": MOE_BACKENDS, "gemm": GEMM_BACKENDS}
_PACKAGES = {"flashinfer": "the flashinfer package (pip install flashinfer-python==0.5.3)",
             "triton": "the triton package",
             "deep_gemm": f"the deep_gemm package (pip install 'pdserve[gpu]' installs {deep_gemm_ops.PINNED})"}


def _has_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _package_imports(name: str) -> bool:
    if name == "flashinfer":
        return flashinfer_attention.flashinfer is not None
    if name == "triton":
        return triton_installed()
    return importlib.util.find_spec(name) is not None


def _lacks(kind: str, name: str, device: torch.device | str) -> tuple[bool, bool]:
    """(lacks a GPU it needs, lacks its package) for backend `name` of `kind` on `device`."""
    needs_gpu = name != "torch" and not (name == "triton" and interpreter_requested())  # interpreter: tests only
    has_package = name not in _PACKAGES or _package_imports(name)
    return needs_gpu and not _has_cuda(device), not has_package


def _fails_here(name: str) -> str | None:
    """Why an installed backend with its GPU still cannot run (deep_gemm: wrong torch build, pre-Hopper GPU), or
    None. Only asked once the package and the GPU are there."""
    return deep_gemm_ops.unusable_reason() if name == "deep_gemm" else None


def available_backends(kind: str, device: torch.device | str) -> list[str]:
    """Registered backends of `kind` ("attention", "moe", "gemm") that can run on `device`, sorted."""
    return [n for n in REGISTRIES[kind].names() if not any(_lacks(kind, n, device)) and _fails_here(n) is None]


def available_attention_backends(device: torch.device | str) -> list[str]:
    """Attention backends that can run on `device`: "torch" always; "triton" on CUDA (or on the CPU with
    TRITON_INTERPRET=1, for tests); "flashinfer" on CUDA with the flashinfer package."""
    return available_backends("attention", device)


def validate_backend(kind: str, name: str, device: torch.device | str) -> None:
    """Raise ValueError naming what is missing when backend `name` of `kind` cannot run on `device`."""
    if kind not in REGISTRIES:
        raise ValueError(f"unknown backend kind {kind!r}; choose one of: {', '.join(REGISTRIES)}")
    no_gpu, no_package = _lacks(kind, name, device)
    if name not in REGISTRIES[kind] and not no_package:
        REGISTRIES[kind].get(name)  # raises: unknown name, listing the choices
    flag, where = f"--{kind}-backend {name}", torch.device(device)
    if no_gpu and no_package:
        raise ValueError(f"{flag} needs a CUDA GPU and {_PACKAGES[name]}; this machine has neither")
    if no_package:
        detail = f" ({flashinfer_attention.FLASHINFER_IMPORT_ERROR})" if name == "flashinfer" else ""
        raise ValueError(f"{flag} needs {_PACKAGES[name]}, which does not import here{detail}")
    if no_gpu and name == "triton":
        raise ValueError(f"{flag} needs CUDA (set TRITON_INTERPRET=1 only for tests); the device is {where}"
                         + ("" if torch.cuda.is_available() else " and this machine has no CUDA GPU"))
    if no_gpu:
        raise ValueError(f"{flag} needs a CUDA GPU; the device is {where}"
                         + ("" if torch.cuda.is_available() else " and this machine has no CUDA GPU"))
    reason = _fails_here(name)
    if reason is not None:
        raise ValueError(f"{flag} cannot run here: {reason}")


# Fastest first; the torch references always exist. deep_gemm where its build runs here, then scaled_mm, then triton
# (see benchmarks/results/README.md, `moe`).
PREFERENCE = {"attention": ("flashinfer", "triton", "torch"), "moe": ("deep_gemm", "triton", "torch"),
              "gemm": ("deep_gemm", "scaled_mm", "triton", "torch")}


# Decoding under CUDA graphs: FlashInfer schedules on the host, so each graphed step re-plans before its replay,
# which costs more than its kernels save up to batch 32 (see benchmarks/results/README.md, `decode`). Prefill and eager decoding keep FlashInfer first.
GRAPHED_DECODE_ATTENTION = ("triton", "flashinfer", "torch")


def resolve_backend(kind: str, name: str, device: torch.device | str,
                    preference: tuple[str, ...] | None = None) -> str:
    """`auto` -> the first backend of `preference` (default: the fastest of `kind`) that runs on `device`; an
    explicit name is validated."""
    if name == "auto":
        available = available_backends(kind, device)
        return next(n for n in preference or PREFERENCE[kind] if n in available)
    validate_backend(kind, name, device)
    return name


def resolve_backends(attention: str, moe: str, device: torch.device | str,
                     graphed_decode: bool = False, gemm: str = "auto") -> tuple[str, str, str]:
    """The CLI's --attention-backend/--moe-backend (and --gemm-backend); a dense GEMM left at `auto` is torch when
    MoE is torch (the reference path), else the fastest that runs here. graphed_decode: the engine decodes under
    CUDA graphs (attention `auto` then prefers our Triton MLA kernel, see GRAPHED_DECODE_ATTENTION)."""
    moe_name = resolve_backend("moe", moe, device)
    if gemm == "auto" and moe_name == "torch":
        gemm = "torch"
    gemm = resolve_backend("gemm", gemm, device)
    preference = GRAPHED_DECODE_ATTENTION if graphed_decode and _has_cuda(device) else None
    return resolve_backend("attention", attention, device, preference), moe_name, gemm
