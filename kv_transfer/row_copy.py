"""One Triton kernel that moves a room's rows from the slots of one pool into the slots of another, every layer in a
single launch: `dst[layer, dst_rows[t]] = src[layer, src_rows[t]]` for every layer and token.

Why: on one GPU a room's bytes cost the device microseconds, and what it costs beyond them is the host's calls (each
torch call tens of microseconds on a busy host) and a second pass over the bytes. torch has no single op that reads
by one index and writes by another, so the transport's torch path gathers the rows into a block of its own
(`gather_layers`, a pass over the bytes) and scatters that block into the pages (`scatter_pages`, a second one),
each with its events and stream switches. This kernel reads the caller's pool (or its rows) and writes the peer's
mapped pool directly: one launch, one pass.

Rows move as whole words (8, 4, 2 or 1 bytes, the widest every row and stride allows), in segments of up to 128
contiguous bytes, so the loads and stores are vectorised whatever the element type.

Users: the cuda_ipc sender on one GPU (the caller's pool straight into the peer's mapped pool) and the nixl receiver
(a staged room's block into its pages). Imports triton: imported lazily (`pages.row_copy_for`), only where a pool is
on a GPU, never at package import (a CPU test module may still turn Triton's interpreter on, see
`tests/test_kv_transfer_rowcopy_interpret.py`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

_WORDS = (torch.int64, torch.int32, torch.int16, torch.int8)
_SEGMENT_BYTES = 128  # the most a row segment moves per program and step: a full cache line
_MAX_SEGMENTS = 64  # segments per row unrolled in the kernel; rows that need more are not this kernel's
BLOCK_T = 64  # tokens per program


@triton.jit(do_not_specialize=["num_tokens"])
def _copy_rows_kernel(src, src_rows, dst, dst_rows, num_tokens, src_layer_stride, src_row_stride, dst_layer_stride,
                      dst_row_stride, ROW_WORDS: tl.constexpr, SEG: tl.constexpr, BLOCK_T: tl.constexpr,
                      INDEXED_SRC: tl.constexpr):
    layer = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) token positions of the room
    live = t < num_tokens
    if INDEXED_SRC:
        s_row = tl.load(src_rows + t, mask=live, other=0).to(tl.int64)
    else:
        s_row = t.to(tl.int64)
    d_row = tl.load(dst_rows + t, mask=live, other=0).to(tl.int64)
    s_base = layer * src_layer_stride + s_row * src_row_stride  # (BLOCK_T,) words
    d_base = layer * dst_layer_stride + d_row * dst_row_stride
    col = tl.arange(0, SEG)
    for k in tl.static_range(ROW_WORDS // SEG):
        off = k * SEG + col  # (SEG,) a contiguous segment of the row
        v = tl.load(src + s_base[:, None] + off[None, :], mask=live[:, None])
        tl.store(dst + d_base[:, None] + off[None, :], v, mask=live[:, None])


def word_of(*tensors: torch.Tensor) -> Optional[torch.dtype]:
    """The widest word every tensor's rows `(..., rows, row_elems)` can be viewed as (row size, every stride, the
    offset and the address divisible by it, rows contiguous within themselves); None for none."""
    for word in _WORDS:
        size = word.itemsize
        if all(t.stride(-1) == 1 and t.shape[-1] * t.element_size() % size == 0
               and all(s * t.element_size() % size == 0 for s in t.stride()[:-1])
               and t.data_ptr() % size == 0 for t in tensors):
            return word
    return None


def copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor,
              src_rows: Optional[torch.Tensor] = None) -> bool:
    """`dst[l, dst_rows[t]] = src[l, src_rows[t]]` (without `src_rows`: `src[l, t]`) for every layer `l` and token
    `t < dst_rows.numel()`, queued on the current stream as one kernel; True. `dst, src: (layers, rows, row_elems)`
    of one dtype on one device (a GPU, or the CPU under Triton's interpreter); `dst_rows`, `src_rows`: `(tokens,)`
    integer tensors there. False, nothing queued, for tensors the kernel does not take (rows not of whole words, or
    of more than `_MAX_SEGMENTS` segments): the caller copies them another way.

    NOTE: the indices are not checked on the device: every `dst_rows` entry must lie inside `dst` and every
    `src_rows` entry inside `src` (callers check the peer's pages on the host before any write)."""
    tokens = dst_rows.numel()
    assert dst.dim() == 3 and src.dim() == 3 and dst.shape[0] == src.shape[0] and dst.shape[2] == src.shape[2] \
        and dst.dtype == src.dtype and dst.device == src.device, \
        (tuple(dst.shape), dst.dtype, dst.device, tuple(src.shape), src.dtype, src.device)
    assert (src.shape[1] >= tokens) if src_rows is None else (src_rows.numel() == tokens), (tokens, tuple(src.shape))
    word = word_of(dst, src)
    if word is None:
        return False
    row_words = dst.shape[2] * dst.element_size() // word.itemsize
    seg = _segment(row_words, word)
    if row_words // seg > _MAX_SEGMENTS:
        return False
    if tokens == 0 or dst.shape[0] == 0:
        return True
    d, s = dst.view(word), src.view(word)  # (layers, rows, row_words)
    _copy_rows_kernel[(triton.cdiv(tokens, BLOCK_T), d.shape[0])](
        s, s if src_rows is None else src_rows, d, dst_rows, tokens, s.stride(0), s.stride(1), d.stride(0),
        d.stride(1), ROW_WORDS=row_words, SEG=seg, BLOCK_T=BLOCK_T, INDEXED_SRC=src_rows is not None, num_warps=4)
    return True


def warm_up(device: torch.device, dtype: torch.dtype, row_elems: int) -> None:
    """Compile (or load from Triton's cache) the kernel's variants for rows of `row_elems` `dtype` values on `device`,
    read by index and in order, before a transfer needs them: a first compile takes about a second. Rows moved later
    between tensors whose strides Triton specialises otherwise (not multiples of 16 words) compile once more."""
    device = torch.device(device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # (Triton's device)
        src = torch.zeros(1, BLOCK_T, row_elems, dtype=dtype, device=device)  # (1, rows, row_elems)
        dst = torch.zeros_like(src)
        rows = torch.arange(BLOCK_T, device=device)
        copy_rows(dst, rows, src, rows)
        copy_rows(dst, rows, src)
        if dst.is_cuda:
            torch.cuda.synchronize(device)


def _segment(row_words: int, word: torch.dtype) -> int:
    """The largest power of two dividing the row's words, at most `_SEGMENT_BYTES` of them."""
    return min(row_words & -row_words, _SEGMENT_BYTES // word.itemsize)


__all__ = ["BLOCK_T", "copy_rows", "warm_up", "word_of"]
