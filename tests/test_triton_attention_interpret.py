"""Our Triton attention kernels against the torch reference backend, on the CPU under Triton's interpreter.

Tiny shapes (the interpreter runs every program in numpy), ragged batches, unordered page tables padded with page
ids that must never be read, non-contiguous views, rows with no keys, outputs poisoned with NaN before the run.
fp32 to 1e-4, fp16 to 1e-2, bf16 by each row's relative error <= 2e-2 (through tests/triton_interpreter.py, since
the bare interpreter's tl.dot multiplies bf16 bit patterns).

tests/interpreter_mode.py sets TRITON_INTERPRET=1 at collection (or reruns this module in a fresh process).
"""

from __future__ import annotations

import pytest
import torch

from interpreter_mode import enter_interpreter

rerun = enter_interpreter(__file__, "tests/test_gpu_attention.py")

from pdserve.kernels import ATTENTION_BACKENDS  # noqa: E402
from pdserve.kernels.attention import TorchAttention, merge_state  # noqa: E402

if rerun is not None:
    test_interpreted_in_a_fresh_process = rerun
else:
    from pdserve.kernels import triton_attention  # noqa: F401  (registers "triton")
    from pdserve.kernels.triton_mla_decode import (MAX_SPLITS, MIN_TOKENS_PER_SPLIT, DecodeConfig,
                                                   choose_num_splits, mla_decode)
    from pdserve.kernels.triton_ragged_prefill import PrefillConfig, ragged_prefill, split_head_dim

    REF = TorchAttention()
    NEVER_READ = 10**6  # page-table padding: a page id far outside the pool

    def paged_case(page_size: int, seq_lens: list[int], heads: int, rank: int, rope: int, dtype, seed: int):
        """A pool with pages in random order; rows' page lists padded with NEVER_READ; q as strided views."""
        gen = torch.Generator().manual_seed(seed)
        num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
        kv = torch.randn(num_pages * page_size, rank + rope, generator=gen).to(dtype)
        perm = torch.randperm(num_pages, generator=gen).tolist()
        tables, used = [], 0
        for n in seq_lens:
            need = -(-n // page_size)
            tables.append(perm[used: used + need])
            used += need
        width = max(map(len, tables)) + 1  # one spare column everywhere: capacity beyond the longest row
        table = torch.tensor([t + [NEVER_READ] * (width - len(t)) for t in tables])
        batch = len(seq_lens)
        q_lat = torch.randn(batch, heads, rank + 8, generator=gen).to(dtype)[..., :rank]  # strided view
        q_pe = torch.randn(batch, heads, rope, generator=gen).to(dtype)
        return q_lat, q_pe, kv, table, torch.tensor(seq_lens)

    def reference_decode(q_lat, q_pe, kv, table, seq_lens, page_size, scale):
        # fp32 reference; it slices only the pages a row needs, so the NEVER_READ padding is fine there too
        return REF.mla_decode(q_lat.float(), q_pe.float(), kv.float(), table, seq_lens, page_size, scale)

    @pytest.mark.parametrize("page_size", [1, 4, 16])
    @pytest.mark.parametrize("heads", [3, 5])
    def test_mla_decode_matches_reference(page_size, heads):
        # lengths: one key, exactly one and two full pages (boundaries), one past a boundary, zero keys, ragged.
        seq_lens = [1, page_size, 2 * page_size, 2 * page_size + 1, 0, 37]
        q_lat, q_pe, kv, table, lens = paged_case(page_size, seq_lens, heads, 32, 16, torch.float32, page_size)
        ref = reference_decode(q_lat, q_pe, kv, table, lens, page_size, 0.2)
        max_splits = table.shape[1]
        for splits in sorted({None, 1, 3, max_splits}, key=lambda s: s or 0):
            out = torch.full_like(ref, float("nan"))
            mla_decode(q_lat, q_pe, kv, table, lens, page_size, 0.2, out=out, num_splits=splits)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4, msg=f"num_splits={splits}")

    @pytest.mark.parametrize("page_size", [16, 64])
    def test_mla_decode_small_tiles_and_int32_indices(page_size):
        """Tiles inside a page (one page-table load per tile; at page 64 four tiles per page, lengths ending inside
        any of them) and pages smaller than a tile (one per row), int32 page table and lengths."""
        q_lat, q_pe, kv, table, lens = paged_case(page_size, [5, 16, 50, 100, 129], 4, 32, 16, torch.float32, 7)
        ref = reference_decode(q_lat, q_pe, kv, table, lens, page_size, 0.3)
        for cfg in (DecodeConfig(block_h=16, block_n=16), DecodeConfig(block_h=32, block_n=128)):
            for splits in (1, 2):
                out = mla_decode(q_lat, q_pe, kv, table.int(), lens.int(), page_size, 0.3, config=cfg,
                                 num_splits=splits)
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

    def test_mla_decode_fp16_and_odd_rope():
        """fp16 in, fp16 out (fp32 accumulation); rope 8 is padded to the 16-wide tile (the reference test's shape)."""
        q_lat, q_pe, kv, table, lens = paged_case(4, [3, 9, 22], 5, 32, 8, torch.float16, 11)
        ref = reference_decode(q_lat, q_pe, kv, table, lens, 4, 0.2)
        out = mla_decode(q_lat, q_pe, kv, table, lens, 4, 0.2)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)

    def test_mla_decode_lengths_change_in_place():
        """What a CUDA graph replay sees: same tensors and grid, new lengths and page-table contents."""
        q_lat, q_pe, kv, table, lens = paged_case(4, [9, 30, 2], 3, 32, 16, torch.float32, 5)
        splits = 3  # fixed, as a captured graph's grid is
        out = torch.full((3, 3, 32), float("nan"))
        mla_decode(q_lat, q_pe, kv, table, lens, 4, 0.2, out=out, num_splits=splits)
        torch.testing.assert_close(out, reference_decode(q_lat, q_pe, kv, table, lens, 4, 0.2), rtol=1e-4, atol=1e-4)
        lens.copy_(torch.tensor([1, 17, 12]))
        table[2, :3] = table[0, :3].clone()  # row 2 now reads row 0's pages
        out.fill_(float("nan"))
        mla_decode(q_lat, q_pe, kv, table, lens, 4, 0.2, out=out, num_splits=splits)
        torch.testing.assert_close(out, reference_decode(q_lat, q_pe, kv, table, lens, 4, 0.2), rtol=1e-4, atol=1e-4)

    def test_choose_num_splits_depends_on_shapes_only():
        knobs = dict(programs_per_sm=2, min_tokens_per_split=512)  # explicit: the defaults are the sweep's to pick
        assert choose_num_splits(64, 16, 64, 64, 16, 132, **knobs) == 5  # V3 TP8 decode, 4096 tokens: 320 programs
        assert choose_num_splits(64, 128, 64, 64, 64, 132, **knobs) == 3
        assert choose_num_splits(1, 16, 1, 16, 16, 132, **knobs) == 1  # capacity below one split's worth
        assert choose_num_splits(256, 128, 256, 16, 16, 132, **knobs) == 1  # enough programs already
        assert choose_num_splits(64, 16, 64, 64, 16, 132, programs_per_sm=8, min_tokens_per_split=256) == 16
        assert choose_num_splits(64, 16, 64, 64, 16, 132, programs_per_sm=1.5, min_tokens_per_split=512) == 4
        assert choose_num_splits(64, 128, 64, 64, 64, 132, programs_per_sm=0.5, min_tokens_per_split=512) == 1
        for batch in (1, 7, 64, 300):  # the module's defaults: within bounds, splits of >= MIN_TOKENS_PER_SPLIT
            for max_pages in (1, 5, 64, 2048):
                splits = choose_num_splits(batch, 16, max_pages, 64, 16, 132)
                assert 1 <= splits <= min(max_pages, MAX_SPLITS)
                assert splits == 1 or -(-max_pages // splits) * 64 >= MIN_TOKENS_PER_SPLIT
                assert -(-max_pages // -(-max_pages // splits)) == splits  # no split left empty

    def test_no_length_dependent_argument_picks_a_kernel_variant():
        """Triton compiles a variant per constexpr value and per specialization of an integer argument: one that
        follows the request's length would compile in a request the warm-up's lengths missed (tests/test_gpu_warmup.py
        counts them on a GPU). The merge's block is one width for every split count the heuristic gives, and the
        length-derived integers are not specialized."""
        from pdserve.kernels.triton_mla_decode import LENGTH_ARGS, _merge_kernel, _split_kernel, merge_block

        blocks = {merge_block(choose_num_splits(batch, heads, max_pages, page, block_h, 132, programs_per_sm=pps,
                                                min_tokens_per_split=mts))
                  for batch in (1, 2, 3, 8, 64, 256) for heads, block_h in ((16, 16), (128, 64))
                  for max_pages in range(1, 1100, 7) for page in (1, 16, 64)
                  for pps in (0.5, 2, 8) for mts in (64, 512)}
        assert blocks == {merge_block(1)}
        assert merge_block(MAX_SPLITS + 1) > merge_block(1)  # an explicit split count above the cap still fits
        for kernel, names in ((_split_kernel, LENGTH_ARGS), (_merge_kernel, ["num_splits"])):
            if hasattr(kernel, "params"):  # compiled: the JITFunction's parameters
                unspecialized = {p.name for p in kernel.params if p.do_not_specialize}
            else:  # the interpreter's wrapper keeps the decorator's arguments
                unspecialized = set(kernel.kwargs["do_not_specialize"])
            assert set(names) <= unspecialized, f"{kernel}: {set(names) - unspecialized} specialized"

    def ragged_case(q_lens, kv_lens, heads, dqk, dv, seed):
        gen = torch.Generator().manual_seed(seed)
        qo, kvo = [0], [0]
        for a, b in zip(q_lens, kv_lens):
            qo.append(qo[-1] + a)
            kvo.append(kvo[-1] + b)
        q = torch.randn(qo[-1], heads, dqk, generator=gen)
        kv = torch.randn(kvo[-1], heads, dqk + dv, generator=gen)  # k and v as strided views, as in MLA._decompress
        return q, kv[..., :dqk], kv[..., dqk:], qo, kvo

    def check_prefill(q, k, v, qo, kvo, causal, scale, config=None):
        ref_out, ref_lse = REF.ragged_prefill(q, k, v, qo, kvo, causal, scale)
        out = torch.full_like(ref_out, float("nan"))
        lse = torch.full_like(ref_lse, float("nan"))
        ragged_prefill(q, k, v, qo, kvo, causal, scale, out=out, lse=lse, config=config)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys must have lse -inf"
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("causal", [True, False])
    def test_ragged_prefill_matches_reference(causal):
        # causal: a sequence with more queries than keys (its first rows see nothing); non-causal: one with no keys.
        q_lens = [1, 7, 0, 13, 5, 20]
        kv_lens = [1, 7, 0, 13, 3, 20] if causal else [1, 9, 4, 13, 0, 35]
        q, k, v, qo, kvo = ragged_case(q_lens, kv_lens, 3, 24, 16, 1 + causal)
        check_prefill(q, k, v, qo, kvo, causal, 0.3)
        check_prefill(q, k, v, qo, kvo, causal, 0.3, config=PrefillConfig(block_m=32, block_n=16))

    @pytest.mark.parametrize("dqk,dv", [(192, 128), (32, 16), (8, 24)])
    def test_ragged_prefill_head_dims(dqk, dv):
        """V3's 192 = 128 + 64 split, a power of two, and widths below one 16-wide tile."""
        q, k, v, qo, kvo = ragged_case([3, 6], [8, 6], 2, dqk, dv, dqk)
        check_prefill(q, k, v, qo, kvo, True, dqk ** -0.5)

    def test_split_head_dim():
        assert split_head_dim(192) == (128, 128, 64)
        assert split_head_dim(24) == (16, 16, 16)
        assert split_head_dim(128) == (128, 128, 0)
        assert split_head_dim(8) == (16, 16, 0)

    def test_prefill_lse_merges_like_the_reference():
        """Prefix chunk + causal self-attention merged by LSE equals attention over the whole sequence."""
        q, k, v, qo, kvo = ragged_case([6], [16], 2, 24, 16, 4)
        full = REF.ragged_prefill(q, k, v, qo, kvo, True, 0.4)
        prefix = ragged_prefill(q, k[:10], v[:10], [0, 6], [0, 10], False, 0.4)
        own = ragged_prefill(q, k[10:], v[10:], [0, 6], [0, 6], True, 0.4)
        out, lse = merge_state(*own, *prefix)
        torch.testing.assert_close(out, full[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse, full[1], rtol=1e-4, atol=1e-4)

    def test_backend_is_registered_and_matches_reference():
        """The registered backend, as the model calls it (twice: the second prefill reuses cached metadata)."""
        attn = ATTENTION_BACKENDS.get("triton")()
        q, k, v, qo, kvo = ragged_case([4, 9], [4, 9], 3, 24, 16, 9)
        ref = REF.ragged_prefill(q, k, v, qo, kvo, True, 0.3)
        for _ in range(2):
            out, lse = attn.ragged_prefill(q, k, v, qo, kvo, True, 0.3)
            torch.testing.assert_close(out, ref[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(lse, ref[1], rtol=1e-4, atol=1e-4)
        q_lat, q_pe, kv, table, lens = paged_case(4, [6, 13], 4, 32, 16, torch.float32, 3)
        out = attn.mla_decode(q_lat, q_pe, kv, table, lens, 4, 0.2)
        torch.testing.assert_close(out, reference_decode(q_lat, q_pe, kv, table, lens, 4, 0.2), rtol=1e-4, atol=1e-4)

    def test_bf16_with_gpu_arithmetic():
        """bf16 in and out, with tests/triton_interpreter.py making the interpreter's bf16 dot and rounding match the
        GPU's; compared with the fp32 reference by the relative error of each row."""
        exact_interpreter = pytest.importorskip("triton_interpreter").exact_interpreter

        def rel_err_rows(out, ref):
            diff = (out.float() - ref.float()).flatten(1).norm(dim=1)
            return float((diff / ref.float().flatten(1).norm(dim=1).clamp(min=1e-6)).max())

        q_lat, q_pe, kv, table, lens = paged_case(4, [3, 9, 22, 40], 5, 32, 16, torch.bfloat16, 13)
        ref = reference_decode(q_lat, q_pe, kv, table, lens, 4, 0.2)
        q, k, v, qo, kvo = ragged_case([5, 12], [9, 12], 3, 24, 16, 14)
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        ref_out, ref_lse = REF.ragged_prefill(q.float(), k.float(), v.float(), qo, kvo, True, 0.3)
        with exact_interpreter():
            out = mla_decode(q_lat, q_pe, kv, table, lens, 4, 0.2, num_splits=2)
            p_out, p_lse = ragged_prefill(q, k, v, qo, kvo, True, 0.3)
        assert out.dtype == p_out.dtype == torch.bfloat16
        assert rel_err_rows(out, ref) <= 2e-2
        assert rel_err_rows(p_out, ref_out) <= 2e-2
        torch.testing.assert_close(p_lse, ref_lse, rtol=0, atol=2e-2)
