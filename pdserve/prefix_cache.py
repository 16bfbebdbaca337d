"""Prefix cache over page-aligned token blocks, keyed by a hash chain.

Block i of a sequence is its tokens `[i * page_size, (i + 1) * page_size)`; its key hashes the key of block i-1 and
its own tokens, so a key names the whole prefix up to the end of the block. Keys are blake2b digests of
little-endian int64 token ids: the same on every process and machine, so they can be published (e.g. to Redis).

The cache holds one reference on every page it has registered. Registered blocks stay prefix-closed (a block's
predecessor is cached whenever the block is), which eviction keeps by removing only blocks with no cached successor.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pdserve.common.blocks import block_hashes, iter_block_hashes
from pdserve.kv_cache import PageAllocator


@dataclass
class _Block:
    page: int
    parent: Optional[bytes]  # key of the previous block in the chain; None for a first block
    num_children: int = 0  # cached blocks whose parent is this one; only childless blocks may be evicted
    last_used: int = 0  # logical clock of the latest match/insert that touched it


class PrefixCache:
    """Maps block keys to pages of a `PageAllocator`, with LRU eviction of pages only the cache still holds.

    `on_evict(keys)` is called after each eviction with the keys that were removed.
    """

    def __init__(self, allocator: PageAllocator, page_size: int,
                 on_evict: Optional[Callable[[list[bytes]], None]] = None):
        if page_size <= 0:
            raise ValueError(f"page_size={page_size} must be positive")
        self.allocator = allocator
        self.page_size = page_size
        self.on_evict = on_evict
        self._blocks: dict[bytes, _Block] = {}
        self._page_key: dict[int, bytes] = {}  # registered page -> its key; a page holds exactly one block
        self._clock = 0
        self.hit_tokens = 0  # tokens served from the cache by match(), summed over calls
        self.queried_tokens = 0  # prompt tokens passed to match(), summed over calls

    def _touch(self, block: _Block) -> None:
        self._clock += 1
        block.last_used = self._clock

    def match(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Longest cached prefix of `token_ids` as (pages, num_cached_tokens), leaving at least one token uncached.

        The caller receives one reference on each returned page and must decref them when done. The pages hold
        finished KV and must not be written; `num_cached_tokens` is a multiple of page_size, so the first
        uncached token starts a fresh page.
        """
        # NOTE: at least the last prompt token must go through the model to produce logits, hence len - 1.
        max_blocks = max(len(token_ids) - 1, 0) // self.page_size
        pages: list[int] = []
        for key in iter_block_hashes(token_ids, self.page_size, max_blocks):
            block = self._blocks.get(key)
            if block is None:
                break
            self._touch(block)
            pages.append(block.page)
        self.allocator.incref(pages)
        num_cached = len(pages) * self.page_size
        self.hit_tokens += num_cached
        self.queried_tokens += len(token_ids)
        return pages, num_cached

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Register the full blocks of `token_ids`, stored in `pages`; returns how many blocks were new.

        Only pass tokens whose KV has been written: the last sampled token of a request has not been run
        through the model yet. A key that is already cached keeps its existing page (this request's page for that
        block stays private to it), so inserting the same sequence again changes nothing.
        """
        keys = block_hashes(token_ids, self.page_size)
        if len(pages) < len(keys):
            raise ValueError(f"{len(keys)} full blocks of tokens but only {len(pages)} pages")
        parent: Optional[bytes] = None
        num_new = 0
        for key, page in zip(keys, pages):
            block = self._blocks.get(key)
            if block is None:
                assert page not in self._page_key, f"page {page} is already registered under another key"
                self.allocator.incref([page])  # the cache's own reference
                self.allocator.track(page, True)
                block = _Block(page=page, parent=parent)
                self._blocks[key] = block
                self._page_key[page] = key
                if parent is not None:
                    self._blocks[parent].num_children += 1
                num_new += 1
            self._touch(block)
            parent = key
        return num_new

    def _evictable_leaf(self, block: _Block) -> bool:
        return block.num_children == 0 and self.allocator.refcount(block.page) == 1

    def evict(self, num_pages_needed: int) -> int:
        """Free up to `num_pages_needed` pages held only by the cache, least recently used leaf first."""
        if num_pages_needed <= 0:
            return 0
        # last_used values are unique (one clock tick per touch), so heap entries never compare the keys.
        heap = [(b.last_used, k) for k, b in self._blocks.items() if self._evictable_leaf(b)]
        heapq.heapify(heap)
        removed: list[bytes] = []
        while heap and len(removed) < num_pages_needed:
            _, key = heapq.heappop(heap)
            block = self._blocks.pop(key)
            del self._page_key[block.page]
            self.allocator.track(block.page, False)
            self.allocator.decref([block.page])
            removed.append(key)
            if block.parent is not None:
                parent = self._blocks[block.parent]
                parent.num_children -= 1
                if self._evictable_leaf(parent):
                    heapq.heappush(heap, (parent.last_used, block.parent))
        if removed and self.on_evict is not None:
            self.on_evict(removed)
        return len(removed)

    def alloc_with_eviction(self, n: int) -> list[int] | None:
        """Allocate `n` pages, evicting cached pages if needed; None (and nothing evicted) if it cannot succeed."""
        pages = self.allocator.alloc(n)
        if pages is not None:
            return pages
        shortfall = n - self.allocator.num_free
        if shortfall > self.num_evictable_pages:
            return None  # evicting would destroy cached prefixes without making room
        freed = self.evict(shortfall)
        assert freed == shortfall, f"evicted {freed} of {shortfall} evictable pages"
        pages = self.allocator.alloc(n)
        assert pages is not None
        return pages

    def reset(self) -> int:
        """Drop every page only the cache holds; returns pages freed.

        Blocks still used by a request stay registered, and so do their predecessors (prefix closure).
        """
        return self.evict(len(self._blocks))

    @property
    def num_cached_pages(self) -> int:
        return len(self._blocks)

    @property
    def num_evictable_pages(self) -> int:
        """Pages repeated eviction could free: cache-only blocks with no request-held block after them."""
        pinned: set[bytes] = set()
        for key, block in self._blocks.items():
            if self.allocator.refcount(block.page) == 1:
                continue
            # A request holds this block: it and every predecessor must stay.
            k: Optional[bytes] = key
            while k is not None and k not in pinned:
                pinned.add(k)
                k = self._blocks[k].parent
        return len(self._blocks) - len(pinned)

    @property
    def num_cache_only_pages(self) -> int:
        """Registered pages that no request holds (refcount 1: the cache's own reference)."""
        return self.allocator.num_tracked_alone  # kept by the allocator: this gauge is read every step

    def hashes(self) -> list[bytes]:
        """Keys currently registered, in registration order."""
        return list(self._blocks)
