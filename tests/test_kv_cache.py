import random

import pytest
import torch

from pdserve.kv_cache import CacheConfig, LatentKVPool, PageAllocator, token_slots


# ---- CacheConfig ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["page_size", "num_pages"])
@pytest.mark.parametrize("value", [0, -3])
def test_cache_config_rejects_non_positive(field, value):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})


def test_cache_config_defaults():
    cfg = CacheConfig()
    assert (cfg.page_size, cfg.num_pages, cfg.num_slots) == (16, 512, 16 * 512)


# ---- PageAllocator --------------------------------------------------------------------------------------------
def test_alloc_free_accounting_to_zero():
    a = PageAllocator(8)
    assert (a.num_free, a.num_used) == (8, 0)
    p1 = a.alloc(3)
    p2 = a.alloc(5)
    assert sorted(p1 + p2) == list(range(8))
    assert (a.num_free, a.num_used) == (0, 8)
    assert all(a.refcount(p) == 1 for p in p1 + p2)
    a.decref(p1)
    a.decref(p2)
    assert (a.num_free, a.num_used) == (8, 0)
    assert all(a.refcount(p) == 0 for p in range(8))


def test_alloc_zero_and_negative():
    a = PageAllocator(2)
    assert a.alloc(0) == []
    assert a.num_used == 0
    with pytest.raises(ValueError):
        a.alloc(-1)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


def test_exhaustion_returns_none_and_takes_nothing():
    a = PageAllocator(4)
    assert a.alloc(3) is not None
    assert a.alloc(2) is None
    assert a.num_free == 1  # the failed call took nothing
    assert a.alloc(1) == [3]
    assert a.alloc(1) is None


def test_refcounts_keep_shared_pages_alive():
    a = PageAllocator(4)
    pages = a.alloc(2)
    a.incref(pages)
    a.incref(pages[:1])
    assert [a.refcount(p) for p in pages] == [3, 2]
    a.decref(pages)
    assert a.num_used == 2  # still held
    a.decref(pages)
    assert [a.refcount(p) for p in pages] == [1, 0]
    assert a.num_used == 1
    a.decref(pages[:1])
    assert a.num_used == 0


def test_decref_of_free_page_is_a_bug():
    a = PageAllocator(4)
    pages = a.alloc(1)
    a.decref(pages)
    with pytest.raises(AssertionError):
        a.decref(pages)
    with pytest.raises(AssertionError):
        a.incref([2])  # never allocated


def test_allocation_is_lowest_id_first_and_deterministic():
    a = PageAllocator(6)
    assert a.alloc(3) == [0, 1, 2]
    a.decref([1])
    a.decref([0])
    assert a.alloc(3) == [0, 1, 3]  # lowest free ids, ascending, regardless of the order they were freed in

    def run():
        b = PageAllocator(16)
        x, y = b.alloc(5), b.alloc(4)
        b.decref(x[1::2])
        return b.alloc(6)

    assert run() == run() == [1, 3, 9, 10, 11, 12]


# ---- LatentKVPool ---------------------------------------------------------------------------------------------
def test_pool_shape_and_nbytes():
    pool = LatentKVPool(3, 576, CacheConfig(page_size=4, num_pages=10), dtype=torch.bfloat16)
    # 10 allocatable pages plus the scratch page that padded CUDA-graph rows write to.
    assert pool.kv.shape == (3, 44, 576)
    assert pool.num_slots == 40 and pool.scratch_page == 10
    assert pool.nbytes == 3 * 44 * 576 * 2
    assert pool.layer(1).shape == (44, 576)
    assert pool.allocator.num_pages == 10
    with pytest.raises(ValueError, match="kv_dim"):
        LatentKVPool(1, 0, CacheConfig())
    with pytest.raises(ValueError, match="num_layers"):
        LatentKVPool(0, 8, CacheConfig())


def test_slots_for_matches_page_math():
    pool = LatentKVPool(1, 8, CacheConfig(page_size=4, num_pages=10))
    pages = [7, 2, 5]
    assert pool.slots_for(pages, 0, 12).tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    assert pool.slots_for(pages, 3, 6).tolist() == [31, 8, 9]
    assert pool.slots_for(pages, 5, 5).tolist() == []
    assert pool.slots_for([], 0, 0).tolist() == []
    with pytest.raises(ValueError):
        pool.slots_for(pages, 0, 13)  # past the last page
    with pytest.raises(ValueError):
        pool.slots_for(pages, 4, 3)


def test_token_slots_follow_the_page_formula_for_every_range():
    """The slots against the formula itself, position by position (every start and end, within and across pages)."""
    rng = random.Random(0)
    for _ in range(500):
        page_size = rng.choice([1, 3, 16, 64])
        pages = rng.sample(range(200), rng.randint(0, 9))
        end = rng.randint(0, len(pages) * page_size)
        start = rng.randint(0, end)
        want = [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
        assert token_slots(pages, end, page_size, start).tolist() == want


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_write_gather_round_trip_non_contiguous(page_size):
    g = torch.Generator().manual_seed(page_size)
    num_pages, kv_dim, layers = 40, 12, 2
    pool = LatentKVPool(layers, kv_dim, CacheConfig(page_size=page_size, num_pages=num_pages))
    # Two sequences interleaved over a shuffled set of pages; lengths are ragged (not page multiples).
    perm = torch.randperm(num_pages, generator=g).tolist()
    lens = [3 * page_size + 1, 5 * page_size - 1]
    n_pages = [-(-n // page_size) for n in lens]
    tables = [perm[: n_pages[0]], perm[n_pages[0] : n_pages[0] + n_pages[1]]]
    data = {}
    for layer in range(layers):
        for s, (table, n) in enumerate(zip(tables, lens)):
            values = torch.randn(n, kv_dim, generator=g)
            # Written in two chunks, as prefill then decode would.
            cut = n // 2
            pool.write(layer, pool.slots_for(table, 0, cut), values[:cut])
            pool.write(layer, pool.slots_for(table, cut, n), values[cut:])
            data[layer, s] = values
    for (layer, s), values in data.items():
        out = pool.gather(layer, tables[s], lens[s])
        assert out.shape == (lens[s], kv_dim)
        torch.testing.assert_close(out, values, rtol=0, atol=0)
        # The layer view sees the same slots.
        torch.testing.assert_close(pool.layer(layer)[pool.slots_for(tables[s], 0, lens[s])], values, rtol=0, atol=0)
    # Pages used by neither sequence were never written.
    unused = perm[sum(n_pages):]
    assert torch.count_nonzero(pool.kv[:, pool.slots_for(unused, 0, len(unused) * page_size)]) == 0


def test_write_casts_dtype_and_checks_shape():
    pool = LatentKVPool(1, 4, CacheConfig(page_size=2, num_pages=2), dtype=torch.bfloat16)
    v = torch.tensor([[1.5, 2.0, -3.0, 0.25]])
    pool.write(0, pool.slots_for([1], 1, 2), v)
    assert pool.kv.dtype == torch.bfloat16
    assert pool.kv[0, 3].float().tolist() == v[0].tolist()
    with pytest.raises(ValueError):
        pool.write(0, pool.slots_for([1], 0, 2), v)  # 2 slots, 1 row


def test_page_table_tensor_pads():
    pool = LatentKVPool(1, 4, CacheConfig(page_size=2, num_pages=8))
    t = pool.page_table_tensor([[3, 1, 4], [5], []], pad=-1)
    assert t.dtype == torch.long
    assert t.tolist() == [[3, 1, 4], [5, -1, -1], [-1, -1, -1]]
    assert pool.page_table_tensor([[2], [6, 7]]).tolist() == [[2, 0], [6, 7]]
    assert pool.page_table_tensor([]).shape == (0, 0)
