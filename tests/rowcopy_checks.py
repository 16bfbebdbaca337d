"""The checks of `kv_transfer/row_copy.py`, shared by its interpreted (CPU) and compiled (GPU) tests: the kernel
against the plain torch reference `dst[:, dst_rows] = src[:, src_rows]`, on fresh random rows, over a sweep of
shapes (ragged token counts, rows that are not a power of two, several element widths), into a poisoned pool that
must stay poisoned outside the rows written."""

from __future__ import annotations

import torch

from pdserve.kv_transfer import row_copy

# (layers, src_slots, dst_slots, tokens, row_elems, dtype, indexed source)
CASES = [
    (3, 300, 400, 77, 576, torch.bfloat16, True),  # DeepSeek-V3's latent rows, gathered by slot from a pool
    (3, 300, 400, 77, 576, torch.bfloat16, False),  # rows in order (the caller's own block)
    (2, 130, 260, 129, 24, torch.float32, True),  # more than two programs' worth of tokens, 96-byte rows
    (1, 5, 9, 1, 3, torch.bfloat16, True),  # one token, 6-byte rows (moved as 2-byte words)
    (4, 64, 64, 64, 7, torch.float16, False),  # every slot, odd rows
    (2, 50, 70, 33, 40, torch.uint8, True),  # 1-byte values, 40-byte rows (8-byte words)
]


def check_copy_rows(device, layers, src_slots, dst_slots, tokens, row_elems, dtype, indexed):
    gen = torch.Generator().manual_seed(layers * 1000 + tokens)
    src = torch.randint(-100, 100, (layers, src_slots, row_elems), generator=gen).to(dtype).to(device)
    dst = torch.full((layers, dst_slots, row_elems), 77, dtype=dtype, device=device)  # poisoned
    src_rows = torch.randperm(src_slots, generator=gen)[:tokens].to(device) if indexed else None
    dst_rows = torch.randperm(dst_slots, generator=gen)[:tokens].to(device)
    expected = dst.clone()
    expected[:, dst_rows] = src[:, src_rows] if indexed else src[:, :tokens]
    assert row_copy.copy_rows(dst, dst_rows, src, src_rows)
    if dst.is_cuda:
        torch.cuda.synchronize(device)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def check_refused(device):
    """Rows of more segments than the kernel unrolls (1-byte words, an odd row length) are left to the caller."""
    src = torch.ones(1, 4, 129, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    rows = torch.arange(4, device=device)
    assert not row_copy.copy_rows(dst, rows, src, rows)
    assert not dst.any()
