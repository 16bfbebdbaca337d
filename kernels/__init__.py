"""Kernel seam: every operation the model calls, each behind a backend registry.

The `torch` backends are the references (plain PyTorch, correct on the CPU); GPU backends register beside them
and are chosen at run time. `KernelBackends` bundles one choice per kind and is passed explicitly to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .attention import ATTENTION_BACKENDS, AttentionBackend
from .gemm import GEMM_BACKENDS, GemmBackend
from .moe import MOE_BACKENDS, MoEBackend
# Register the GPU backends whose packages are installed (none of these imports triton or deep_gemm itself).
from . import (deep_gemm_dense, deep_gemm_moe, flashinfer_attention, triton_attention, triton_gemm,  # noqa: F401,E402
               triton_moe)


@dataclass(frozen=True)
class KernelBackends:
    attention: AttentionBackend
    moe: MoEBackend
    gemm: GemmBackend

    @classmethod
    def create(cls, attention: str = "torch", moe: str = "torch", gemm: str = "torch") -> "KernelBackends":
        return cls(
            attention=ATTENTION_BACKENDS.get(attention)(),
            moe=MOE_BACKENDS.get(moe)(),
            gemm=GEMM_BACKENDS.get(gemm)(),
        )


__all__ = ["KernelBackends", "ATTENTION_BACKENDS", "MOE_BACKENDS", "GEMM_BACKENDS",
           "AttentionBackend", "MoEBackend", "GemmBackend"]
