"""Paged latent KV cache for MLA: a page allocator with reference counts and the tensor pool it indexes.

MLA caches one latent vector per token per layer (kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 values for
DeepSeek-V3), shared by all heads, so the pool is a single tensor `(num_layers, num_slots, kv_dim)`. Token position
`p` of a sequence whose page table is `pages` lives in slot `pages[p // page_size] * page_size + p % page_size`.

Pages are reference counted so that requests can share prefix pages with each other and with the prefix cache
(`pdserve.prefix_cache`): a page returns to the free list when its last holder lets go.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


def token_slots(pages: Sequence[int], end: int, page_size: int, start: int = 0,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Flat slot ids `(end - start,)` of token positions `start .. end-1` of a sequence with page table `pages`.

    The one place positions become slots: position p lives in slot `pages[p // page_size] * page_size + p % page_size`.
    """
    if not 0 <= start <= end <= len(pages) * page_size:
        raise ValueError(f"token range [{start}, {end}) does not fit {len(pages)} pages of {page_size}")
    table = torch.tensor(list(pages), dtype=torch.long, device=device)  # (num_pages_of_seq,)
    pos = torch.arange(start, end, dtype=torch.long, device=device)  # (n,)
    return table[pos // page_size] * page_size + pos % page_size  # (n,)


def page_runs(
    src_pages: Sequence[int], dst_pages: Sequence[int], num_tokens: int, page_size: int
) -> list[tuple[int, int, int]]:
    """Coalesce two page tables into `(src_first_slot, dst_first_slot, num_slots)` runs that are contiguous on
    both sides and cover token positions `[0, num_tokens)` exactly, in token order (the last run may end inside
    a page). One run = one memcpy / RDMA write."""
    if page_size <= 0 or num_tokens < 0:
        raise ValueError(f"page_size={page_size} must be positive and num_tokens={num_tokens} non-negative")
    need = -(-num_tokens // page_size)
    if len(src_pages) < need or len(dst_pages) < need:
        raise ValueError(f"{num_tokens} tokens need {need} pages of {page_size}; got {len(src_pages)} source "
                         f"and {len(dst_pages)} destination pages")
    runs: list[tuple[int, int, int]] = []
    for i in range(need):
        n = min(page_size, num_tokens - i * page_size)
        src, dst = src_pages[i] * page_size, dst_pages[i] * page_size
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((src, dst, n))
    return runs


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16  # tokens per page
    num_pages: int = 512  # pages in the pool (all layers share one page table)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"CacheConfig.page_size={self.page_size} must be a positive number of tokens per page")
        if self.num_pages <= 0:
            raise ValueError(f"CacheConfig.num_pages={self.num_pages} must be a positive number of pages")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size


class PageAllocator:
    """Reference-counted pages `0 .. num_pages-1`.

    Allocation is deterministic: the lowest free page ids are handed out first, in ascending order (a min-heap),
    so the same sequence of calls always yields the same page ids.
    """

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages} must be positive")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free = list(range(num_pages))  # already a valid min-heap
        self._num_free = num_pages
        # Pages the prefix cache registered (it holds one reference to each), and how many of those it alone holds:
        # kept as references change, because counting them is a walk over the whole cache (every step, for a gauge).
        self._tracked = [False] * num_pages
        self._num_tracked_alone = 0
        self.on_alone: Optional[Callable[[int], None]] = None  # told of a tracked page whose last request let go

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free pages with a reference count of 1 each; None (and nothing taken) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._num_free:
            return None
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            assert self._refcount[p] == 0, f"page {p} on the free list has refcount {self._refcount[p]}"
            self._refcount[p] = 1
        self._num_free -= n
        return pages

    def incref(self, pages: Sequence[int]) -> None:
        """Add one holder to each page; the pages must already be allocated."""
        for p in pages:
            assert 0 <= p < self.num_pages, f"page {p} out of range [0, {self.num_pages})"
            assert self._refcount[p] > 0, f"incref of free page {p}"
            self._refcount[p] += 1
            if self._tracked[p] and self._refcount[p] == 2:
                self._num_tracked_alone -= 1

    def decref(self, pages: Sequence[int]) -> None:
        """Drop one holder from each page; a page with no holders left returns to the free list."""
        for p in pages:
            assert 0 <= p < self.num_pages, f"page {p} out of range [0, {self.num_pages})"
            # NOTE: a double free would hand the same page to two sequences and silently corrupt both caches.
            assert self._refcount[p] > 0, f"decref of free page {p}"
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                assert not self._tracked[p], f"page {p} freed while the prefix cache still has it"
                heapq.heappush(self._free, p)
                self._num_free += 1
            elif self._refcount[p] == 1 and self._tracked[p]:
                self._num_tracked_alone += 1
                if self.on_alone is not None:
                    self.on_alone(p)

    def track(self, page: int, tracked: bool) -> None:
        """Mark a page the prefix cache registers (True, after taking its reference) or drops (False, before letting
        it go), so that `num_tracked_alone` follows it."""
        assert self._refcount[page] > 0 and self._tracked[page] != tracked, f"page {page}: track({tracked})"
        self._tracked[page] = tracked
        if self._refcount[page] == 1:
            self._num_tracked_alone += 1 if tracked else -1

    @property
    def num_tracked_alone(self) -> int:
        """Tracked pages with one reference: the prefix cache's pages that no request holds."""
        return self._num_tracked_alone

    def refcount(self, page: int) -> int:
        assert 0 <= page < self.num_pages, f"page {page} out of range [0, {self.num_pages})"
        return self._refcount[page]

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free


class LatentKVPool:
    """The latent MLA cache of every layer, `kv: (num_layers, num_pages * page_size, kv_dim)`, and its allocator."""

    def __init__(
        self,
        num_layers: int,
        kv_dim: int,
        cache_config: CacheConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_layers <= 0:
            raise ValueError(f"num_layers={num_layers} must be positive")
        if kv_dim <= 0:
            raise ValueError(f"kv_dim={kv_dim} must be positive (576 for DeepSeek-V3: 512 latent + 64 rope)")
        self.num_layers = num_layers
        self.kv_dim = kv_dim
        self.config = cache_config
        self.page_size = cache_config.page_size
        self.num_pages = cache_config.num_pages
        self.dtype = dtype
        self.device = torch.device(device)
        # NOTE: zeros, not empty: attention kernels read whole pages, and garbage NaNs in unwritten slots survive
        # a zero softmax weight (0 * NaN = NaN), so a stale slot must at least be finite.
        # One page beyond the allocator's, never handed out: padded rows of a CUDA-graph batch write there.
        self.kv = torch.zeros(num_layers, cache_config.num_slots + self.page_size, kv_dim, dtype=dtype,
                              device=self.device)
        self.scratch_page = cache_config.num_pages
        self.allocator = PageAllocator(cache_config.num_pages)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def slots_for(self, pages: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat slot ids `(end - start,)` of token positions `start .. end-1` of a sequence with page table `pages`."""
        return token_slots(pages, end, self.page_size, start, self.device)

    def layer(self, layer: int) -> torch.Tensor:
        """View `(num_slots, kv_dim)` of one layer's cache; writes through it land in the pool."""
        return self.kv[layer]

    def write(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store `values: (n, kv_dim)` into slots `(n,)` of `layer`; slots must be distinct."""
        if values.shape != (slots.numel(), self.kv_dim):
            raise ValueError(f"values of shape {tuple(values.shape)} do not match {slots.numel()} slots "
                             f"x kv_dim {self.kv_dim}")
        self.kv[layer].index_copy_(0, slots.to(self.device), values.to(device=self.device, dtype=self.dtype))

    def gather(self, layer: int, pages: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Copy `(num_tokens, kv_dim)` of a sequence's first `num_tokens` positions out of `layer`."""
        return self.kv[layer].index_select(0, self.slots_for(pages, 0, num_tokens))

    def page_table_tensor(self, page_lists: Sequence[Sequence[int]], pad: int = 0) -> torch.Tensor:
        """Page tables of a batch as `(batch, max_pages)` long on the pool's device, short rows padded with `pad`."""
        width = max((len(p) for p in page_lists), default=0)
        table = torch.full((len(page_lists), width), pad, dtype=torch.long)  # (batch, max_pages), built on host
        for i, pages in enumerate(page_lists):
            if pages:
                table[i, : len(pages)] = torch.tensor(list(pages), dtype=torch.long)
        return table.to(self.device)  # one host-to-device copy for the whole batch
