"""What one model forward computes: flattened tokens of several sequences plus where their KV lives.

Built by the model runner from scheduled requests; consumed by the model. Two modes:
- EXTEND (prefill, chunked prefill, prefix-cache hits): each sequence adds q_len new tokens after prefix_len
  tokens already in the cache. Attention is non-absorbed MHA: new tokens causally over themselves, plus the
  decompressed cached prefix in chunks.
- DECODE: each row is one query token (a request's next token, or one of several speculative positions) with
  its own page-table row and seq_len (keys visible to it, itself included). Attention is absorbed MLA.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    out_slots: torch.Tensor  # (T,) int64: flat pool slot where each token's latent KV is written
    page_size: int
    # EXTEND: per sequence
    qo_indptr: Optional[list[int]] = None  # (B+1,) cumulative new-token counts
    prefix_lens: Optional[list[int]] = None  # (B,) tokens already cached before this chunk
    page_tables: Optional[list[list[int]]] = None  # (B,) page ids covering prefix + new tokens
    # DECODE: per row (= per token)
    page_table: Optional[torch.Tensor] = None  # (T, max_pages) int64
    seq_lens: Optional[torch.Tensor] = None  # (T,) int64
    # Called with the KV layer index as soon as that layer's KV is written (layer-wise KV streaming in prefill).
    layer_done: Optional[Callable[[int], None]] = None
    # DP attention (pdserve.parallel.dp_attention). dp_ranks: in a whole step, each sequence's DP rank; dp: in one
    # rank's part of a step, its DPLayout (the layers gather every rank's tokens for the MLP through it).
    dp_ranks: Optional[list[int]] = None
    dp: Any = None

    def __post_init__(self) -> None:
        t = self.input_ids.shape[0]
        assert self.positions.shape == (t,) and self.out_slots.shape == (t,), "per-token tensors disagree"
        if self.mode is ForwardMode.EXTEND:
            assert self.qo_indptr is not None and self.prefix_lens is not None and self.page_tables is not None
            assert self.qo_indptr[-1] == t and len(self.prefix_lens) == len(self.qo_indptr) - 1
        else:
            assert self.page_table is not None and self.seq_lens is not None
            assert self.page_table.shape[0] == t and self.seq_lens.shape == (t,)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.qo_indptr) - 1 if self.mode is ForwardMode.EXTEND else self.num_tokens
