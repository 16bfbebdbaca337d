"""Prefix cache over page-aligned token blocks, keyed by a hash chain.

Block i of a sequence is its tokens `[i * page_size, (i + 1) * page_size)`; its key hashes the key of block i-1 and
its own tokens, so a key names the whole prefix up to the end of the block. Keys are blake2b digests of
little-endian int64 token ids: the same on every process and machine, so they can be published (e.g. to Redis).

The cache holds one reference on every page it has registered. Registered blocks stay prefix-closed (a block's
predecessor is cached whenever the block is), which eviction keeps by removing only blocks with no cached successor.

Eviction takes the least recently used *evictable leaf* (no cached successor, no holder but the cache) first. A full
cache is the steady state of a busy worker, where every allocation evicts; so the candidates are kept in one heap
across calls instead of being collected by a walk over the whole cache per allocation (which cost a prefill worker
milliseconds per prompt with a few thousand cached pages). An entry is pushed whenever a block may have become an
evictable leaf (its last request let go of its page, its last successor was evicted, it was touched while one);
entries that no longer describe an evictable leaf are dropped when they surface.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pdserve.common.blocks import leading_block_hashes
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
        self._heap: list[tuple[int, bytes]] = []  # (last_used, key) of possible evictable leaves, stale ones included
        allocator.on_alone = self._page_alone
        self.hit_tokens = 0  # tokens served from the cache by match(), summed over calls
        self.queried_tokens = 0  # prompt tokens passed to match(), summed over calls

    def _touch(self, block: _Block, key: bytes) -> None:
        self._clock += 1
        block.last_used = self._clock
        self._offer(block, key)  # (its entry with the old time is stale now)

    def _offer(self, block: _Block, key: bytes) -> None:
        """Push the block as an eviction candidate if it is an evictable leaf now."""
        if self._evictable_leaf(block):
            heapq.heappush(self._heap, (block.last_used, key))
            self._compact()  # a cache that never fills evicts never: stale entries must not pile up meanwhile

    def _page_alone(self, page: int) -> None:  # PageAllocator.on_alone: the cache is its page's only holder now
        key = self._page_key[page]
        self._offer(self._blocks[key], key)

    def match(self, token_ids: Sequence[int], memo: Optional[list[bytes]] = None) -> tuple[list[int], int]:
        """Longest cached prefix of `token_ids` as (pages, num_cached_tokens), leaving at least one token uncached.
        `memo`: the sequence's block keys made so far (see `leading_block_hashes`), reused and extended.

        The caller receives one reference on each returned page and must decref them when done. The pages hold
        finished KV and must not be written; `num_cached_tokens` is a multiple of page_size, so the first
        uncached token starts a fresh page.
        """
        # NOTE: at least the last prompt token must go through the model to produce logits, hence len - 1.
        max_blocks = max(len(token_ids) - 1, 0) // self.page_size
        # The first block's key alone first: where it is not cached (every fresh prompt) no later block can be, and
        # the other keys are left to the insert after the prompt's forward, off its first token's way (hashing a
        # long prompt whole is host work on the engine thread before its forward).
        keys = leading_block_hashes(token_ids, self.page_size, min(1, max_blocks), memo)
        if keys and keys[0] in self._blocks:
            keys = leading_block_hashes(token_ids, self.page_size, max_blocks, memo)
        pages: list[int] = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            self._touch(block, key)
            pages.append(block.page)
        self.allocator.incref(pages)
        num_cached = len(pages) * self.page_size
        self.hit_tokens += num_cached
        self.queried_tokens += len(token_ids)
        return pages, num_cached

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], memo: Optional[list[bytes]] = None) -> int:
        """Register the full blocks of `token_ids`, stored in `pages`; returns how many blocks were new.

        Only pass tokens whose KV has been written: the last sampled token of a request has not been run
        through the model yet. A key that is already cached keeps its existing page (this request's page for that
        block stays private to it), so inserting the same sequence again changes nothing.
        """
        keys = leading_block_hashes(token_ids, self.page_size, len(token_ids) // self.page_size, memo)
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
            self._touch(block, key)
            parent = key
        return num_new

    def _evictable_leaf(self, block: _Block) -> bool:
        return block.num_children == 0 and self.allocator.refcount(block.page) == 1

    def evict(self, num_pages_needed: int) -> int:
        """Free up to `num_pages_needed` pages held only by the cache, least recently used leaf first."""
        return self._evict(self._victims(num_pages_needed))

    def alloc_with_eviction(self, n: int) -> list[int] | None:
        """Allocate `n` pages, evicting cached pages if needed; None (and nothing evicted) if it cannot succeed."""
        pages = self.allocator.alloc(n)
        if pages is not None:
            return pages
        shortfall = n - self.allocator.num_free
        if shortfall > self.allocator.num_tracked_alone:
            return None  # fewer cache-only pages than needed (O(1)): evicting would not make room
        victims = self._victims(shortfall)
        if len(victims) < shortfall:  # cache-only pages before a request-held block: cannot go
            for key in victims:  # chosen, not evicted: back in the heap
                heapq.heappush(self._heap, (self._blocks[key].last_used, key))
            return None
        self._evict(victims)
        pages = self.allocator.alloc(n)
        assert pages is not None
        return pages

    def _victims(self, n: int) -> list[bytes]:
        """Up to `n` keys in eviction order, nothing evicted yet: a leaf's predecessor becomes a candidate once all
        its successors are among them."""
        victims: list[bytes] = []
        if n <= 0:
            return victims
        chosen: set[bytes] = set()
        children_left: dict[bytes, int] = {}  # successors not chosen, of the chosen blocks' predecessors
        while self._heap and len(victims) < n:
            last_used, key = heapq.heappop(self._heap)
            block = self._blocks.get(key)
            if (block is None or block.last_used != last_used or key in chosen
                    or children_left.get(key, block.num_children) or self.allocator.refcount(block.page) != 1):
                continue  # stale: evicted, touched since, or not an evictable leaf (pushed again when it becomes one)
            victims.append(key)
            chosen.add(key)
            if block.parent is not None:
                left = children_left[block.parent] = children_left.get(
                    block.parent, self._blocks[block.parent].num_children) - 1
                parent = self._blocks[block.parent]
                if left == 0 and self.allocator.refcount(parent.page) == 1:
                    heapq.heappush(self._heap, (parent.last_used, block.parent))
        self._compact()
        return victims

    def _evict(self, victims: list[bytes]) -> int:
        for key in victims:  # leaves first: each block's successors went before it
            block = self._blocks.pop(key)
            del self._page_key[block.page]
            self.allocator.track(block.page, False)
            self.allocator.decref([block.page])
            if block.parent is not None:
                self._blocks[block.parent].num_children -= 1
        if victims and self.on_evict is not None:
            self.on_evict(victims)
        return len(victims)

    def _compact(self) -> None:
        """Rebuild the heap from the evictable leaves once stale entries outnumber the cache (amortized O(1))."""
        if len(self._heap) > 2 * len(self._blocks) + 64:
            self._heap = [(b.last_used, k) for k, b in self._blocks.items() if self._evictable_leaf(b)]
            heapq.heapify(self._heap)

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
        """Pages repeated eviction could free: cache-only blocks with no request-held block after them (a walk over
        the whole cache: for tests and tools, not per allocation)."""
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
