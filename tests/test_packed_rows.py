"""The packed layout that fills a CUDA graph's inputs in one copy (ModelRunner.pack_rows): real rows first, then
padding rows that only touch the pool's scratch page. The eager path builds its batches from the same layout, so
every CPU engine test runs it; this test pins the padding the graph path adds."""

from __future__ import annotations

import torch

from pdserve.kv_cache import CacheConfig, LatentKVPool
from pdserve.model_runner import ModelRunner, TokenRow
from pdserve.request import Request
from pdserve.sampling import SamplingParams


def test_pack_rows_pads_to_the_bucket_with_scratch_rows():
    pool = LatentKVPool(1, 8, CacheConfig(page_size=4, num_pages=16), torch.float32, "cpu")
    runner = ModelRunner(None, pool, "cpu")
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(), pages=[7, 3])
    b = Request("b", [1, 2], SamplingParams(), pages=[9])
    rows = [TokenRow(a, 5, 11), TokenRow(b, 1, 12), TokenRow(a, 6, 13)]
    packed = runner.pack_rows(rows, num_rows=4, width=3)
    scratch = pool.scratch_page
    assert (packed.num_rows, packed.rows, packed.width) == (3, 4, 3)
    ids, positions, slots, seq_lens = packed.header.tolist()
    assert ids == [11, 12, 13, 0]
    assert positions == [5, 1, 6, 0]
    assert slots == [3 * 4 + 1, 9 * 4 + 1, 3 * 4 + 2, scratch * 4]  # position 5 = page 1 (id 3), offset 1
    assert seq_lens == [6, 2, 7, 1]
    assert packed.page_table.tolist() == [[7, 3, scratch], [9, scratch, scratch], [7, 3, scratch],
                                          [scratch] * 3]


def test_rows_batch_is_the_unpadded_layout():
    pool = LatentKVPool(1, 8, CacheConfig(page_size=4, num_pages=16), torch.float32, "cpu")
    runner = ModelRunner(None, pool, "cpu")
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(), pages=[7, 3])
    batch = runner.rows_batch([TokenRow(a, 4, 5)])
    assert batch.input_ids.tolist() == [5] and batch.positions.tolist() == [4]
    assert batch.out_slots.tolist() == [3 * 4] and batch.seq_lens.tolist() == [5]
    assert batch.page_table.tolist() == [[7, 3]]
