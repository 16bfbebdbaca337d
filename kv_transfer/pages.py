"""Where a room's rows go in a pool of pages, and the copy that puts them there.

A room's rows travel as contiguous blocks `(layers, tokens, kv_dim)`, in token order, whatever the destination
pages: the sender gathers them from its pool (one gather per run of layers, `gather_chunks`), each block crosses the
link in one operation, and one scatter per block (`scatter_pages`) puts them into the reserved pages on the receiving
pool's device. The transfer costs a fixed time per operation on every link (a peer copy, an NCCL op, a NIXL
descriptor), so one per page run or per layer would cost far more than the bytes; a large room goes as a few runs of
layers rather than one block only so that one run's gather, crossing and scatter overlap the next one's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .base import gather_layers, page_runs

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
            out = layer_kv[..., dst:dst + count, :]
            part = rows if src == 0 and count == rows.shape[-2] else rows[..., src:src + count, :]
            # NOTE: a run of several layers is strided in the pool (one block per layer), which torch copies one
            # element per step like index_copy_: as wider elements the same bytes take fewer steps.
            word = _widest_word(out, part) if out.dim() > 2 else None
            if word is not None:
                out, part = out.view(word), part.view(word)
            out.copy_(part, non_blocking=True)
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


# A room crossing between GPUs is cut into runs of layers of about this many bytes (at most MAX_CHUNKS), so its
# gather, its peer copy and its scatter overlap: each run's copy starts as soon as its own gather is done, and its
# scatter runs while the next run crosses. Each run costs the host a few launches, so runs stay large.
CHUNK_BYTES, MAX_CHUNKS = 64 << 20, 8


@dataclass(frozen=True)
class Chunk:
    """A run of a room's layers gathered into a block of their own: `first` is its first layer in the send,
    `rows: (layers, num_tokens, kv_dim)`, `ready` an event after its gather on a GPU (None on the CPU)."""

    first: int
    rows: torch.Tensor
    ready: object


def gather_chunks(source: torch.Tensor, slots: Optional[torch.Tensor], chunks: int) -> list[Chunk]:
    """`gather_layers(source, slots)` for a run of layers `(layers, slots, kv_dim)`, cut into `chunks` runs of layers,
    each gathered on the current stream with an event after it: whatever reads a run waits for its gather only."""
    slots = None if slots is None else slots.to(source.device)
    num_layers = source.shape[0]
    step = -(-num_layers // max(1, min(chunks, num_layers)))
    out = []
    for first in range(0, num_layers, step):
        rows = gather_layers(source[first:first + step], slots)  # (layers of the run, num_tokens, kv_dim)
        ready = None
        if rows.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(rows.device))
        out.append(Chunk(first, rows, ready))
    return out


def chunk_count(nbytes: int) -> int:
    """How many runs of layers a send of `nbytes` crossing between GPUs is cut into."""
    return max(1, min(MAX_CHUNKS, nbytes // CHUNK_BYTES))


def copy_across(layer_kv: torch.Tensor, chunks: list[Chunk], plan: PagePlan, scatter_stream: torch.cuda.Stream) -> None:
    """`scatter_pages` of the chunks' rows on one GPU into `layer_kv: (layers, slots, kv_dim)` on another, as a
    pipeline: each chunk crosses the link into a staging block on the pool's GPU once its gather is done, and its
    scatter runs on `scatter_stream` while the next chunk crosses (the copy engines and the pool GPU's cores at
    once).

    NOTE: called with the rows' device's current stream the one that copies, and on the pool's device a current
    stream with nothing queued that the copies should wait for: torch orders a copy between GPUs after both devices'
    current streams, so were `scatter_stream` current there, each block would wait for the previous block's scatter.
    The caller waits for `scatter_stream` (an event recorded on it after this returns)."""
    stage = torch.cuda.current_stream(layer_kv.device)
    for chunk in chunks:
        rows = chunk.rows
        copy_stream = torch.cuda.current_stream(rows.device)
        if chunk.ready is not None:
            copy_stream.wait_event(chunk.ready)
        staged = rows.to(layer_kv.device, non_blocking=True)  # (chunk, num_tokens, kv_dim) peer copy
        rows.record_stream(copy_stream)  # the allocator must not hand its memory out before the copy read it
        scatter_stream.wait_stream(stage)  # that copy landed (stage waits for it)
        with torch.cuda.stream(scatter_stream):
            scatter_pages(layer_kv[chunk.first:chunk.first + rows.shape[0]], staged, plan)
        staged.record_stream(scatter_stream)  # allocated on the stage stream, read by the scatter


__all__ = ["CHUNK_BYTES", "MAX_CHUNKS", "Chunk", "PagePlan", "chunk_count", "copy_across", "gather_chunks", "plan_pages",
           "scatter_pages"]
