"""Where a room's rows go in a pool of pages, and the copy that puts them there.

A room's rows travel as one contiguous block `(layers, tokens, kv_dim)`, in token order, whatever the destination
pages: the sender gathers them from its pool in one gather, they cross the link in one operation, and one scatter
(`scatter_pages`) puts them into the reserved pages on the receiving pool's device. The transfer costs a fixed time
per operation on every link (a peer copy, an NCCL op, a NIXL descriptor), so one per page run or per layer would
cost far more than the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .base import page_runs

# 16-, 8- and 4-byte elements: index_copy_'s CUDA kernel moves one element per thread step (the kernel is picked by
# element size only), so the same bytes as wider elements take fewer steps.
_WORDS = (torch.complex128, torch.int64, torch.int32)


@dataclass(frozen=True)
class PagePlan:
    """Where a room's rows go in the pool, worked out once per room (every layer goes to the same slots).

    Position p of the room lands in slot `pages[p // page_size] * page_size + p % page_size` of the pool's layer
    (`token_slots`): the pool has no offset, page k is slots `[k * page_size, (k + 1) * page_size)`; the decode
    pool's spare page after its allocator's (`LatentKVPool.scratch_page`) is one more such page."""

    page_size: int
    num_tokens: int
    runs: tuple[tuple[int, int, int], ...]  # `page_runs`: (first row, first slot, rows), contiguous on both sides
    full_pages: Optional[torch.Tensor]  # (num_tokens // page_size,) long on the pool's device; None: copy by runs
    tail: Optional[tuple[int, int, int]]  # (first row, first slot, rows) of a partial last page, with full_pages


def plan_pages(pages: Sequence[int], num_tokens: int, page_size: int,
               device: torch.device | str | None = None) -> PagePlan:
    """The plan for `num_tokens` rows into `pages` (checked against the pool by the caller). `device`: the pool's,
    where the page indices are put when the pages are more than one run; None: copy by runs."""
    runs = tuple(page_runs(range(-(-num_tokens // page_size)), pages, num_tokens, page_size))
    if device is None or len(runs) <= 1:
        return PagePlan(page_size, num_tokens, runs, None, None)
    full, rest = divmod(num_tokens, page_size)
    # Non-blocking from pageable memory: the source is staged before the call returns, so it may go right after.
    index = torch.tensor(list(pages[:full]), dtype=torch.long).to(device, non_blocking=True)  # (full,)
    tail = (full * page_size, pages[full] * page_size, rest) if rest else None
    return PagePlan(page_size, num_tokens, runs, index, tail)


def scatter_pages(layer_kv: torch.Tensor, rows: torch.Tensor, plan: PagePlan) -> None:
    """Write `rows: (..., num_tokens, kv_dim)` into `layer_kv: (..., slots, kv_dim)` (one layer of the pool, or a
    run of its layers with rows for each) where `plan` says; the result equals `layer_kv.index_copy_(-2,
    token_slots(pages, num_tokens, page_size), rows)` per layer. Queued on the current stream; each layer of both
    tensors contiguous, on one device (`copy_across` brings rows from another GPU)."""
    if (rows.shape[-2] != plan.num_tokens or rows.dtype != layer_kv.dtype or rows.dim() != layer_kv.dim()
            or rows.shape[:-2] != layer_kv.shape[:-2] or rows.shape[-1] != layer_kv.shape[-1]):
        raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} for a plan of {plan.num_tokens} tokens into a "
                         f"pool layer {tuple(layer_kv.shape)} {layer_kv.dtype}")
    if rows.device != layer_kv.device:
        raise ValueError(f"rows on {rows.device}, the pool on {layer_kv.device}: copy_across moves them")
    if plan.full_pages is None:
        for src, dst, count in plan.runs:  # one run is one copy
            layer_kv[..., dst:dst + count, :].copy_(rows[..., src:src + count, :], non_blocking=True)
        return
    ps, kv_dim, lead = plan.page_size, layer_kv.shape[-1], layer_kv.shape[:-2]
    full = plan.full_pages.numel()
    if full:
        # NOTE: one kernel moving whole pages (ps * kv_dim values each) instead of one row index per token:
        # per-token rows of a few hundred bytes ran the scatter at under a third of the copy bandwidth.
        whole = layer_kv.shape[-2] // ps * ps
        pool_pages = layer_kv[..., :whole, :].view(*lead, -1, ps * kv_dim)  # (..., num_pages, ps * kv_dim)
        src = rows[..., :full * ps, :].view(*lead, full, ps * kv_dim)  # (..., full, ps * kv_dim)
        word = _widest_word(pool_pages, src)
        if word is not None:
            pool_pages, src = pool_pages.view(word), src.view(word)
        pool_pages.index_copy_(-2, plan.full_pages, src)
    if plan.tail is not None:
        first_row, first_slot, count = plan.tail
        layer_kv[..., first_slot:first_slot + count, :].copy_(rows[..., first_row:first_row + count, :])


def _widest_word(*tensors: torch.Tensor) -> Optional[torch.dtype]:
    """The widest of `_WORDS` that every tensor's rows can be viewed as (size, alignment, and the strides of the
    leading dims), None for none."""
    for word in _WORDS:
        size = word.itemsize
        if size > tensors[0].element_size() and all(
                t.stride(-1) == 1 and t.shape[-1] * t.element_size() % size == 0
                and all(stride * t.element_size() % size == 0 for stride in t.stride()[:-1])
                and t.storage_offset() * t.element_size() % size == 0 and t.data_ptr() % size == 0 for t in tensors):
            return word
    return None


def copy_across(layer_kv: torch.Tensor, rows: torch.Tensor, plan: PagePlan, scatter_stream: torch.cuda.Stream,
                chunks: int = 4) -> None:
    """`scatter_pages` of `rows: (layers, num_tokens, kv_dim)` on one GPU into `layer_kv: (layers, slots, kv_dim)` on
    another, as a pipeline: the room crosses the link in `chunks` runs of layers, each into a staging block on the
    pool's GPU, and each block's scatter runs on `scatter_stream` while the next block crosses (copy engines and the
    pool GPU's cores at once).

    NOTE: called with the rows' device's current stream ordered after the rows, and on the pool's device a current
    stream with nothing queued that the copies should wait for: torch orders a copy between GPUs after both devices'
    current streams, so were `scatter_stream` current there, each block would wait for the previous block's scatter.
    The caller waits for `scatter_stream` (an event recorded on it after this returns)."""
    stage = torch.cuda.current_stream(layer_kv.device)
    num_layers = rows.shape[0]
    step = -(-num_layers // max(1, min(chunks, num_layers)))
    for first in range(0, num_layers, step):
        last = min(num_layers, first + step)
        staged = rows[first:last].to(layer_kv.device, non_blocking=True)  # (chunk, num_tokens, kv_dim) peer copy
        scatter_stream.wait_stream(stage)  # that copy landed (stage waits for it)
        with torch.cuda.stream(scatter_stream):
            scatter_pages(layer_kv[first:last], staged, plan)
        staged.record_stream(scatter_stream)  # allocated on the stage stream, read by the scatter


__all__ = ["PagePlan", "copy_across", "plan_pages", "scatter_pages"]
