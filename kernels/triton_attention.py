"""The "triton" attention backend: our own Triton kernels for both MLA attention shapes.

- mla_decode: split-KV absorbed MLA over the paged latent cache (kernels/triton_mla_decode.py), CUDA-graph safe.
- ragged_prefill: ragged flash attention, causal or not, natural-log LSE (kernels/triton_ragged_prefill.py).

Registered whenever the triton package is installed; usable on a CUDA GPU (kernels/backends.py validates that),
or on the CPU under TRITON_INTERPRET=1 for tests.
"""

from __future__ import annotations

from typing import Optional

import torch

from .attention import ATTENTION_BACKENDS, AttentionBackend
from .triton_support import triton_installed

_META_CACHE_ENTRIES = 16


class TritonAttention(AttentionBackend):
    """Triton kernels; fp32, bf16 and fp16 inputs, fp32 accumulation."""

    graph_safe = True  # decode reads lengths on the device; the grid depends only on static shapes

    def __init__(self) -> None:
        # NOTE: kernel modules import triton, so they are imported here, not at module import (triton_support.py).
        from . import triton_mla_decode, triton_ragged_prefill

        self._decode, self._prefill = triton_mla_decode, triton_ragged_prefill
        # Prefill metadata per (indptrs, block, device): every layer of a forward reuses the first layer's upload.
        self._meta: dict[tuple, tuple[torch.Tensor, int]] = {}

    def _metadata(self, qo_indptr: list[int], kv_indptr: list[int], block_m: int,
                  device: torch.device) -> tuple[torch.Tensor, int]:
        key = (tuple(qo_indptr), tuple(kv_indptr), block_m, device)
        hit: Optional[tuple[torch.Tensor, int]] = self._meta.get(key)
        if hit is None:
            if len(self._meta) >= _META_CACHE_ENTRIES:
                self._meta.pop(next(iter(self._meta)))
            hit = self._meta[key] = self._prefill.prefill_metadata(qo_indptr, kv_indptr, block_m, device)
        return hit

    def ragged_prefill(self, q, k, v, qo_indptr, kv_indptr, causal, sm_scale):
        cfg = self._prefill.default_prefill_config(q.dtype)
        meta = self._metadata(list(qo_indptr), list(kv_indptr), cfg.block_m, q.device)
        return self._prefill.ragged_prefill(q, k, v, qo_indptr, kv_indptr, causal, sm_scale, meta=meta, config=cfg)

    def mla_decode(self, q_latent, q_pe, kv_layer, page_table, seq_lens, page_size, sm_scale):
        return self._decode.mla_decode(q_latent, q_pe, kv_layer, page_table, seq_lens, page_size, sm_scale)


if triton_installed():
    ATTENTION_BACKENDS.register("triton")(TritonAttention)
