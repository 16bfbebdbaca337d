import hashlib

import pytest
import torch

from pdserve.kv_cache import PageAllocator
from pdserve.common.blocks import block_hashes
from pdserve.prefix_cache import PrefixCache


def make(num_pages=32, page_size=4):
    evicted: list[list[bytes]] = []
    alloc = PageAllocator(num_pages)
    return alloc, PrefixCache(alloc, page_size, on_evict=evicted.append), evicted


def compute(cache, tokens):
    """What the engine does for one prompt: reuse the cached prefix, allocate the rest, register the blocks."""
    pages, cached = cache.match(tokens)
    need = -(-len(tokens) // cache.page_size) - len(pages)
    new = cache.alloc_with_eviction(need)
    assert new is not None
    pages = pages + new
    cache.insert(tokens, pages)
    return pages, cached


# ---- block hashes ---------------------------------------------------------------------------------------------
def test_block_hash_golden():
    # Computed once and pasted in: a change to the scheme (shared with other processes via Redis) must fail here.
    hashes = block_hashes(list(range(8)) + [2**40, -1, 7], 4)
    assert [h.hex() for h in hashes] == ["61abbbbadcb5a29f38974c1405255595", "ceb7796f6f9059e045e6ec8c7df2e484"]
    assert [h.hex() for h in block_hashes([1, 2, 3], 1)] == [
        "9ea2d098b5f70192f96c06f38d3fbc97", "8a8cb33b8580d188a00b9e8a9fc983b6", "8556b7235bfcfffe8278b658079fb359"]


def test_block_hash_follows_the_documented_scheme():
    tokens, ps = [5, -2, 2**33, 0, 9, 9, 9, 9], 4
    prev, expect = b"", []
    for i in range(2):
        data = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[i * ps : (i + 1) * ps])
        prev = hashlib.blake2b(prev + data, digest_size=16).digest()
        expect.append(prev)
    assert block_hashes(tokens, ps) == expect
    assert block_hashes(tuple(tokens), ps) == expect
    assert block_hashes(torch.tensor(tokens), ps) == expect


def test_block_hash_prefix_property():
    ps = 4
    base = list(range(100, 112))
    h = block_hashes(base, ps)
    assert len(h) == 3 and len(set(h)) == 3
    assert len(block_hashes(base[:11], ps)) == 2  # partial blocks get no key
    assert block_hashes(base[:3], ps) == []
    changed_first = [0] + base[1:]
    assert all(a != b for a, b in zip(h, block_hashes(changed_first, ps)))  # every later key depends on token 0
    changed_mid = base[:5] + [0] + base[6:]
    h2 = block_hashes(changed_mid, ps)
    assert h2[0] == h[0] and h2[1] != h[1] and h2[2] != h[2]
    # The same block content at another position (after other tokens) has another key.
    assert block_hashes([7] * 8, ps)[1] != block_hashes([7] * 4, ps)[0]
    with pytest.raises(ValueError):
        block_hashes(base, 0)


def test_a_sequences_keys_are_made_once_through_its_memo(monkeypatch):
    """A request's keys (Request.block_keys) are reused by match, the insert after its prompt and the one at its
    end, and extended only by the blocks its later tokens fill; the cache ends as it would without the memo."""
    import pdserve.common.blocks as blocks

    tokens = list(range(300, 323))  # 5 full blocks of 4 and 3 tokens
    expected = block_hashes(tokens, 4)
    made = []
    real = blocks.hashlib.blake2b
    monkeypatch.setattr(blocks.hashlib, "blake2b", lambda *a, **k: (made.append(1), real(*a, **k))[1])
    memo: list[bytes] = []
    alloc, cache, _ = make(page_size=4)
    pages, _ = cache.match(tokens[:18], memo)  # a fresh prompt of 18: its first block's key, the rest at its insert
    assert len(made) == 1 and memo == expected[:1]
    pages += alloc.alloc(5)
    cache.insert(tokens[:18], pages, memo)
    cache.insert(tokens[:23], pages, memo)  # after 5 generated tokens: one new full block
    assert len(made) == 5 and memo == expected
    monkeypatch.setattr(blocks.hashlib, "blake2b", real)
    plain_alloc, plain, _ = make(page_size=4)
    plain_pages = plain.match(tokens[:18])[0] + plain_alloc.alloc(5)
    plain.insert(tokens[:23], plain_pages)
    assert cache.hashes() == plain.hashes() and pages == plain_pages
    again: list[bytes] = []
    made.clear()
    monkeypatch.setattr(blocks.hashlib, "blake2b", lambda *a, **k: (made.append(1), real(*a, **k))[1])
    hit, cached = cache.match(tokens[:18], again)  # a cached first block: the 4 keys its longest match needs
    assert (hit, cached) == (pages[:4], 16) and len(made) == 4 and again == expected[:4]


# ---- match / insert -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 5])
def test_match_leaves_one_token_uncached(k):
    alloc, cache, _ = make(page_size=4)
    tokens = list(range(4 * k))
    pages, cached = compute(cache, tokens)
    assert cached == 0
    got, n = cache.match(tokens)  # exactly k pages of prompt: the last block must be recomputed
    assert (got, n) == (pages[: k - 1], 4 * (k - 1))
    got2, n2 = cache.match(tokens + [99])
    assert (got2, n2) == (pages[:k], 4 * k)
    assert cache.match([]) == ([], 0)
    assert cache.match(tokens[:1]) == ([], 0)


def test_sharing_prefix_and_refcounts():
    alloc, cache, _ = make(page_size=4)
    a = list(range(10))  # blocks 0, 1 full; 2 tokens in a partial page
    pages_a, _ = compute(cache, a)
    assert len(pages_a) == 3 and cache.num_cached_pages == 2
    assert [alloc.refcount(p) for p in pages_a] == [2, 2, 1]  # request + cache on full blocks
    b = a[:8] + [50, 51, 52]
    pages_b, cached_b = compute(cache, b)
    assert cached_b == 8 and pages_b[:2] == pages_a[:2] and pages_b[2] != pages_a[2]
    assert [alloc.refcount(p) for p in pages_a[:2]] == [3, 3]
    alloc.decref(pages_a)
    alloc.decref(pages_b)
    assert [alloc.refcount(p) for p in pages_a[:2]] == [1, 1]
    assert alloc.num_used == 2  # only the cache's pages remain
    assert cache.hit_tokens == 8 and cache.queried_tokens == 21


def test_insert_is_idempotent():
    alloc, cache, _ = make(page_size=4)
    tokens = list(range(12))
    pages = alloc.alloc(3)
    assert cache.insert(tokens, pages) == 3
    before = [alloc.refcount(p) for p in pages]
    assert cache.insert(tokens, pages) == 0
    assert cache.insert(tokens[:8], pages[:2]) == 0
    assert [alloc.refcount(p) for p in pages] == before == [2, 2, 2]
    assert cache.hashes() == block_hashes(tokens, 4)
    with pytest.raises(ValueError):
        cache.insert(list(range(16)), pages)  # 4 full blocks, 3 pages


def test_insert_keeps_existing_page_for_known_key():
    alloc, cache, _ = make(page_size=4)
    tokens = list(range(12))
    first = alloc.alloc(2)
    cache.insert(tokens[:8], first)
    dup = alloc.alloc(3)  # a concurrent request computed the same prefix into its own pages
    assert cache.insert(tokens, dup) == 1  # only block 2 is new
    assert [alloc.refcount(p) for p in dup] == [1, 1, 2]
    got, n = cache.match(tokens + [0])
    assert (got, n) == ([first[0], first[1], dup[2]], 12)


# ---- eviction -------------------------------------------------------------------------------------------------
def test_evict_lru_first_and_reports_keys():
    alloc, cache, evicted = make(page_size=4)
    prompts = [[i] * 4 for i in range(3)]  # three independent one-block chains
    held = [compute(cache, p)[0] for p in prompts]
    for pages in held:
        alloc.decref(pages)
    cache.match(prompts[0] + [1])  # touch chain 0 -> chain 1 is now least recently used
    alloc.decref([held[0][0]])  # the match's reference
    assert cache.evict(1) == 1
    assert evicted == [block_hashes(prompts[1], 4)]
    assert cache.evict(1) == 1
    assert evicted[-1] == block_hashes(prompts[2], 4)
    assert cache.evict(0) == 0 and len(evicted) == 2  # no empty callback


def test_evict_leaves_first_keeps_chains_prefix_closed():
    alloc, cache, evicted = make(page_size=4)
    tokens = list(range(12))
    pages, _ = compute(cache, tokens)
    alloc.decref(pages)
    h = block_hashes(tokens, 4)
    # Block 0 is the least recently used, but it has cached successors: the tail goes first.
    assert cache.evict(1) == 1 and evicted[-1] == [h[2]]
    assert cache.match(tokens + [0])[1] == 8  # the remaining prefix is still usable
    alloc.decref(pages[:2])
    assert cache.evict(5) == 2 and evicted[-1] == [h[1], h[0]]
    assert cache.num_cached_pages == 0 and alloc.num_used == 0


def test_evict_never_frees_pages_a_request_holds():
    alloc, cache, evicted = make(num_pages=16, page_size=4)
    shared = list(range(8))
    pages_a, _ = compute(cache, shared + [1])
    alloc.decref(pages_a)
    other, _ = compute(cache, [9] * 8)
    alloc.decref(other)
    held, n = cache.match(shared + [2])  # a running request holds both blocks of `shared`
    assert n == 8
    assert cache.num_evictable_pages == 2
    assert cache.evict(100) == 2  # only the other chain
    assert set(cache.hashes()) == set(block_hashes(shared, 4))
    assert [alloc.refcount(p) for p in held] == [2, 2]
    alloc.decref(held)
    assert cache.num_evictable_pages == 2 and cache.evict(100) == 2


def test_request_held_successor_pins_cache_only_predecessors():
    alloc, cache, _ = make(page_size=4)
    tokens = list(range(12))
    first = alloc.alloc(2)
    cache.insert(tokens[:8], first)
    alloc.decref(first)  # blocks 0 and 1: cache only
    dup = alloc.alloc(3)
    cache.insert(tokens, dup)  # block 2 registered on a page the request still holds
    assert cache.num_evictable_pages == 0
    assert cache.evict(10) == 0 and cache.num_cached_pages == 3
    alloc.decref(dup)
    assert cache.num_evictable_pages == 3 and cache.reset() == 3
    assert alloc.num_used == 0


def test_alloc_with_eviction():
    alloc, cache, evicted = make(num_pages=8, page_size=4)
    pages_a, _ = compute(cache, list(range(16)))  # 4 pages, all cached
    alloc.decref(pages_a)
    running = alloc.alloc(2)  # a request's private pages
    assert alloc.num_free == 2 and cache.num_evictable_pages == 4
    assert cache.alloc_with_eviction(7) is None  # 2 free + 4 evictable < 7
    assert evicted == [] and cache.num_cached_pages == 4  # nothing destroyed for nothing
    got = cache.alloc_with_eviction(5)
    assert got is not None and len(got) == 5
    assert cache.num_cached_pages == 1 and len(evicted[0]) == 3  # evicted exactly the shortfall, from the tail
    assert cache.hashes() == block_hashes(list(range(4)), 4)
    assert alloc.num_free == 0
    alloc.decref(got)
    alloc.decref(running)
    assert cache.alloc_with_eviction(0) == []


def test_everything_released_after_requests_finish_and_reset():
    alloc, cache, evicted = make(num_pages=64, page_size=4)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 1000, (9,), generator=g).tolist()
    live = []
    for i in range(12):
        tail = torch.randint(0, 1000, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
        pages, cached = compute(cache, system + tail)
        assert cached == (8 if i else 0)  # the two full blocks of the shared system prompt
        live.append(pages)
    cached_pages = cache.num_cached_pages
    assert cache.reset() == 0 and cache.num_cached_pages == cached_pages  # running requests keep their blocks
    for pages in live:
        alloc.decref(pages)
    freed = cache.reset()
    assert freed > 0 and sum(len(e) for e in evicted) >= freed
    assert cache.num_cached_pages == 0 and cache.hashes() == []
    assert alloc.num_used == 0 and alloc.num_free == 64


def test_cache_only_count_follows_every_reference_change():
    """num_cache_only_pages is kept by the allocator as references change (read every step for a gauge): under
    random requests that share prefixes, finish, hold duplicates of cached blocks and trigger evictions, it always
    equals the count it replaces (registered pages whose only holder is the cache)."""
    import random

    rng = random.Random(5)
    alloc, cache, _ = make(num_pages=48, page_size=4)
    stems = [[rng.randrange(100) for _ in range(12)] for _ in range(4)]
    held: list[list[int]] = []
    for _ in range(400):
        if held and (rng.random() < 0.45 or alloc.num_free < 8):
            alloc.decref(held.pop(rng.randrange(len(held))))  # a request finishes
        else:
            tokens = rng.choice(stems)[: rng.randrange(1, 13)] + [rng.randrange(100) for _ in range(rng.randrange(9))]
            if rng.random() < 0.2:  # computed without the cache (prompt logprobs): own pages, published after
                pages = cache.alloc_with_eviction(-(-len(tokens) // 4))
                if pages is not None:
                    cache.insert(tokens, pages)
            else:
                pages, _ = cache.match(tokens)
                new = cache.alloc_with_eviction(-(-len(tokens) // 4) - len(pages))
                if new is None:
                    alloc.decref(pages)
                    pages = None
                else:
                    pages += new
                    cache.insert(tokens, pages)
            if pages is not None:
                held.append(pages)
        if rng.random() < 0.05:
            cache.reset()
        scanned = sum(1 for b in cache._blocks.values() if alloc.refcount(b.page) == 1)
        assert cache.num_cache_only_pages == scanned
    for pages in held:
        alloc.decref(pages)
    assert cache.num_cache_only_pages == cache.num_cached_pages
    cache.reset()
    assert cache.num_cache_only_pages == 0 and alloc.num_free == 48


def walk_victims(cache, n: int) -> list[bytes]:
    """The eviction the heap replaces, from scratch: collect every evictable leaf, take the least recently used,
    let its predecessor in once it has no successor left, n times (or until none is left)."""
    import heapq

    alone = lambda b: cache.allocator.refcount(b.page) == 1  # noqa: E731
    children = {k: b.num_children for k, b in cache._blocks.items()}
    heap = [(b.last_used, k) for k, b in cache._blocks.items() if children[k] == 0 and alone(b)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < n:
        _, key = heapq.heappop(heap)
        out.append(key)
        parent = cache._blocks[key].parent
        if parent is not None:
            children[parent] -= 1
            if children[parent] == 0 and alone(cache._blocks[parent]):
                heapq.heappush(heap, (cache._blocks[parent].last_used, parent))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_evictions_follow_the_lru_walk_they_replace(seed):
    """The candidate heap kept across calls evicts exactly the blocks, in exactly the order, that a walk over the
    whole cache picks (least recently used evictable leaf first), under random requests that share prefixes, hold
    duplicates of cached blocks (cache-only pages pinned by a request-held successor), finish in any order, and
    allocate from a full pool; an allocation that cannot be met evicts nothing."""
    import random

    rng = random.Random(seed)
    alloc, cache, evicted = make(num_pages=40, page_size=4)
    stems = [[rng.randrange(50) for _ in range(16)] for _ in range(5)]
    held: list[list[int]] = []
    refused = 0
    for _ in range(600):
        if held and rng.random() < 0.3:  # (requests pile up: the pool fills with held pages at times)
            alloc.decref(held.pop(rng.randrange(len(held))))
            continue
        tokens = rng.choice(stems)[: rng.randrange(1, 17)] + [rng.randrange(50) for _ in range(rng.randrange(12))]
        own = rng.random() < 0.2  # computed without the cache: own pages, duplicates of cached blocks
        pages, _ = ([], 0) if own else cache.match(tokens)
        need = -(-len(tokens) // 4) - len(pages)
        shortfall = need - alloc.num_free
        expected = walk_victims(cache, shortfall) if shortfall > 0 else []
        before = len(evicted)
        new = cache.alloc_with_eviction(need)
        if new is None:
            refused += 1
            assert len(expected) < shortfall and len(evicted) == before, "a refused allocation evicted blocks"
            alloc.decref(pages)
            continue
        assert [k for batch in evicted[before:] for k in batch] == expected
        pages += new
        cache.insert(tokens, pages)
        held.append(pages)
        if rng.random() < 0.1:  # an explicit partial eviction
            n = rng.randrange(1, 6)
            expected = walk_victims(cache, n)
            before = len(evicted)
            assert cache.evict(n) == len(expected)
            assert [k for batch in evicted[before:] for k in batch] == expected
    assert refused, "the pool was never too full to refuse an allocation: the test missed that branch"
    for pages in held:
        alloc.decref(pages)
    cache.reset()
    assert alloc.num_free == 40 and cache.num_cached_pages == 0


def test_a_block_touched_by_another_requests_insert_stays_evictable_in_lru_order():
    """A request that computed a cached prefix on its own pages (prompt logprobs) touches the cached blocks when it
    registers: they become the most recently used, and stay evictable after the older ones."""
    alloc, cache, evicted = make(num_pages=8, page_size=4)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    for tokens in (a, b):
        pages, _ = compute(cache, tokens + [0])
        alloc.decref(pages)  # done: blocks a, then b, cache-only leaves
    own = alloc.alloc(1)
    cache.insert(a, own)  # a's key is cached: its page stays, this request's page stays private; a is touched
    alloc.decref(own)
    assert cache.evict(2) == 2
    assert evicted == [block_hashes(b, 4) + block_hashes(a, 4)]  # b first: a was used after it


def test_the_candidate_heap_stays_bounded_when_nothing_is_evicted():
    """A pool that never fills never evicts: the entries pushed as requests come and go are compacted anyway."""
    alloc, cache, evicted = make(num_pages=64, page_size=4)
    for i in range(3000):
        pages, _ = compute(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # the same prompt: its blocks are touched each time
        alloc.decref(pages)
    assert not evicted and len(cache._heap) <= 2 * cache.num_cached_pages + 64
    assert cache.evict(2) == 2  # and what is left in it still evicts
