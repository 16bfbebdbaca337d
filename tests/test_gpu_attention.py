"""GPU attention backends ("triton", "flashinfer") against the fp32 torch reference at DeepSeek-V3 shapes.

Decode: 128 and 16 heads (V3 on 1 and 8 GPUs), R 512, P 64, page sizes 64 and 16, batches up to 64, ragged
contexts up to 4096 with page-boundary lengths, pages in random order, unused page-table entries pointing at real
pages (so reading one would change the result). Prefill: qk 192 / v 128, ragged, causal and not, rows without keys.
bf16 is checked by the relative error of each row (Frobenius norm) <= 2e-2; fp32 (triton only) to 1e-4.
Plus other triton decode tile configs (both page-table paths, deeper pipelines), and CUDA-graph capture/replay of
the decode kernels after seq_lens / page_table change in place.
flashinfer cases skip when it does not import.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pdserve.kernels import ATTENTION_BACKENDS
from pdserve.kernels import flashinfer_attention, triton_attention  # noqa: F401  (register what imports)
from pdserve.kernels.attention import TorchAttention

pytestmark = pytest.mark.gpu

R, P = 512, 64
V3_SCALE = 192 ** -0.5 * (0.1 * 1.0 * math.log(40) + 1) ** 2  # FACTS §5: 0.1352
REF = TorchAttention()


def need(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        pytest.skip(f"{backend} does not import on this machine")
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: triton would run interpreted")


def rel_err_rows(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative error of one row (first dim): ||out_b - ref_b|| / ||ref_b||."""
    diff = (out.float() - ref.float()).flatten(1).norm(dim=1)
    return float((diff / ref.float().flatten(1).norm(dim=1).clamp(min=1e-6)).max())


def decode_case(batch, heads, page_size, max_ctx, dtype, seed, lens=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if lens is None:
        lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen, device="cuda").tolist()
        fixed = [1, page_size, page_size + 1, 2 * page_size, max_ctx]  # one key, page boundaries, the longest
        lens[: min(batch, len(fixed))] = fixed[: min(batch, len(fixed))]
    max_pages = -(-max_ctx // page_size)
    num_pages = sum(-(-n // page_size) for n in lens) + 4
    kv = torch.randn(num_pages * page_size, R + P, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(num_pages, generator=gen, device="cuda").tolist()
    table = torch.tensor(perm[-1:], device="cuda").repeat(batch, max_pages)  # unused entries: a real page
    used = 0
    for b, n in enumerate(lens):
        need_pages = -(-n // page_size)
        table[b, :need_pages] = torch.tensor(perm[used: used + need_pages], device="cuda")
        used += need_pages
    q_lat = torch.randn(batch, heads, R, generator=gen, device="cuda").to(dtype)
    q_pe = torch.randn(batch, heads, P, generator=gen, device="cuda").to(dtype)
    return q_lat, q_pe, kv, table, torch.tensor(lens, device="cuda")


def reference_decode(q_lat, q_pe, kv, table, lens, page_size):
    return REF.mla_decode(q_lat.float(), q_pe.float(), kv.float(), table, lens, page_size, V3_SCALE)


DECODE_SHAPES = [  # (batch, heads, page_size, max context)
    (64, 16, 64, 4096), (64, 128, 64, 4096), (33, 16, 16, 4096), (17, 128, 16, 2048), (1, 128, 64, 100),
    (3, 16, 16, 17),
]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("batch,heads,page_size,max_ctx", DECODE_SHAPES)
def test_mla_decode_bf16(backend, batch, heads, page_size, max_ctx):
    need(backend)
    q_lat, q_pe, kv, table, lens = decode_case(batch, heads, page_size, max_ctx, torch.bfloat16, batch + heads)
    ref = reference_decode(q_lat, q_pe, kv, table, lens, page_size)
    if backend == "triton":
        from pdserve.kernels.triton_mla_decode import mla_decode

        out = torch.full_like(q_lat, float("nan"))
        mla_decode(q_lat, q_pe, kv, table, lens, page_size, V3_SCALE, out=out)
    else:
        dec = flashinfer_attention.FlashInferMLADecode(q_lat.device)
        dec.plan(table, lens, heads, page_size, V3_SCALE, q_lat.dtype, kv.dtype)
        out = dec.run(q_lat, q_pe, kv, out=torch.full_like(q_lat, float("nan")))
    assert out.dtype == torch.bfloat16
    err = rel_err_rows(out, ref)
    print(f"{backend} decode B={batch} H={heads} page={page_size}: max row rel. error {err:.2e}")
    assert err <= 2e-2
    # The registered backend, as the model calls it, agrees with the direct call.
    again = ATTENTION_BACKENDS.get(backend)().mla_decode(q_lat, q_pe, kv, table, lens, page_size, V3_SCALE)
    assert rel_err_rows(again, ref) <= 2e-2


def test_mla_decode_triton_fp32_and_empty_rows():
    need("triton")
    from pdserve.kernels.triton_mla_decode import mla_decode

    q_lat, q_pe, kv, table, lens = decode_case(6, 16, 16, 700, torch.float32, 5, lens=[1, 16, 0, 17, 700, 333])
    ref = reference_decode(q_lat, q_pe, kv, table, lens, 16)
    for splits in (None, 1, table.shape[1]):
        out = mla_decode(q_lat, q_pe, kv, table, lens, 16, V3_SCALE, out=torch.full_like(q_lat, float("nan")),
                         num_splits=splits)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(out[2], torch.zeros_like(out[2]))  # no keys: 0


# Stage-1 configs beside the defaults (block_h, block_n, num_warps, num_stages): the tile-in-page path (block_n
# divides the page: 16 at both pages, 32 at page 64) and the per-row page path (32 at page 16), double- and
# triple-buffered pipelines (5 and 7 stages), mma (block_h 16) and wgmma (block_h 64).
TRITON_DECODE_TILES = [(16, 32, 4, 5), (16, 16, 4, 7), (64, 32, 8, 5)]


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("tile", TRITON_DECODE_TILES)
def test_mla_decode_triton_configs(tile, page_size):
    need("triton")
    from pdserve.kernels.triton_mla_decode import DecodeConfig, mla_decode

    heads = 128 if tile[0] == 64 else 16
    q_lat, q_pe, kv, table, lens = decode_case(11, heads, page_size, 1100, torch.bfloat16, tile[1] + page_size)
    ref = reference_decode(q_lat, q_pe, kv, table, lens, page_size)
    for splits in (1, 3):  # one split writes the output directly; three go through the merge
        out = torch.full_like(q_lat, float("nan"))
        mla_decode(q_lat, q_pe, kv, table, lens, page_size, V3_SCALE, out=out, num_splits=splits,
                   config=DecodeConfig(*tile))
        err = rel_err_rows(out, ref)
        print(f"triton decode {tile} page={page_size} splits={splits}: max row rel. error {err:.2e}")
        assert err <= 2e-2


def test_mla_decode_triton_compile_only_launches_nothing():
    """What the benchmark's compile workers rely on: compile_only writes nothing; the real call then works."""
    need("triton")
    from pdserve.kernels.triton_mla_decode import DecodeConfig, mla_decode

    q_lat, q_pe, kv, table, lens = decode_case(4, 16, 64, 300, torch.bfloat16, 3)
    cfg = DecodeConfig(block_h=16, block_n=64, num_warps=8, num_stages=5)  # no other test uses it: a real compile
    out = torch.full_like(q_lat, float("nan"))
    mla_decode(q_lat, q_pe, kv, table, lens, 64, V3_SCALE, out=out, num_splits=2, config=cfg, compile_only=True)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
    mla_decode(q_lat, q_pe, kv, table, lens, 64, V3_SCALE, out=out, num_splits=2, config=cfg)
    assert rel_err_rows(out, reference_decode(q_lat, q_pe, kv, table, lens, 64)) <= 2e-2


def prefill_case(q_lens, kv_lens, heads, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qo, kvo = [0], [0]
    for a, b in zip(q_lens, kv_lens):
        qo.append(qo[-1] + a)
        kvo.append(kvo[-1] + b)
    q = torch.randn(qo[-1], heads, 192, generator=gen, device="cuda").to(dtype)
    kv = torch.randn(kvo[-1], heads, 192 + 128, generator=gen, device="cuda").to(dtype)
    return q, kv[..., :192], kv[..., 192:], qo, kvo  # k, v strided views, as MLA._decompress makes them


PREFILL_SHAPES = [  # (heads, q_lens, kv_lens when not causal)
    (128, [1, 17, 0, 300, 1024, 5], [1, 40, 64, 300, 2048, 0]),
    (16, [4096, 63, 2], [4096, 1000, 7]),
]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,q_lens,kv_lens", PREFILL_SHAPES)
def test_ragged_prefill_bf16(backend, causal, heads, q_lens, kv_lens):
    need(backend)
    if causal:  # one sequence with fewer keys than queries: its first rows see nothing
        kv_lens = [q if i != 1 else q - 9 for i, q in enumerate(q_lens)]
    q, k, v, qo, kvo = prefill_case(q_lens, kv_lens, heads, torch.bfloat16, heads + causal)
    ref_out, ref_lse = REF.ragged_prefill(q.float(), k.float(), v.float(), qo, kvo, causal, V3_SCALE)
    out, lse = ATTENTION_BACKENDS.get(backend)().ragged_prefill(q, k, v, qo, kvo, causal, V3_SCALE)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    blind = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), blind), "rows without keys must have lse -inf (and only they)"
    assert torch.equal(out[blind.all(1)], torch.zeros_like(out[blind.all(1)]))
    seen = ~blind.all(1)
    err = rel_err_rows(out[seen], ref_out[seen])
    lse_err = float((lse[seen] - ref_lse[seen]).abs().max())
    print(f"{backend} prefill H={heads} causal={causal}: max row rel. error {err:.2e}, max |lse diff| {lse_err:.2e}")
    assert err <= 2e-2 and lse_err <= 2e-2


def test_ragged_prefill_triton_fp32():
    need("triton")
    from pdserve.kernels.triton_ragged_prefill import ragged_prefill

    q, k, v, qo, kvo = prefill_case([1, 70, 5, 200], [1, 70, 2, 333], 16, torch.float32, 3)
    for causal in (True, False):
        ref_out, ref_lse = REF.ragged_prefill(q, k, v, qo, kvo, causal, V3_SCALE)
        out = torch.full_like(ref_out, float("nan"))
        lse = torch.full_like(ref_lse, float("nan"))
        ragged_prefill(q, k, v, qo, kvo, causal, V3_SCALE, out=out, lse=lse)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def _refill(q_lat, q_pe, table, lens, seed, page_size):
    """New inputs in the same tensors (what a graph runner does before replay)."""
    fresh = decode_case(q_lat.shape[0], q_lat.shape[1], page_size, table.shape[1] * page_size, q_lat.dtype, seed)
    for static, new in zip((q_lat, q_pe, table, lens), (fresh[0], fresh[1], fresh[3], fresh[4])):
        static.copy_(new)
    return fresh[2]  # the matching kv pool


def test_mla_decode_triton_cuda_graph_replay():
    need("triton")
    from pdserve.kernels.triton_mla_decode import mla_decode

    batch, heads, page_size, max_ctx = 8, 16, 16, 1024
    q_lat, q_pe, kv, table, lens = decode_case(batch, heads, page_size, max_ctx, torch.bfloat16, 1)
    pool_pages = batch * table.shape[1] + 4  # the most any refill below can use
    kv_pool = torch.zeros(pool_pages * page_size, R + P, dtype=kv.dtype, device="cuda")
    kv_pool[: kv.shape[0]] = kv
    out = torch.empty_like(q_lat)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside capture
        mla_decode(q_lat, q_pe, kv_pool, table, lens, page_size, V3_SCALE, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q_lat, q_pe, kv_pool, table, lens, page_size, V3_SCALE, out=out)

    for seed in (2, 3):
        kv_new = _refill(q_lat, q_pe, table, lens, seed, page_size)
        kv_pool.zero_()
        kv_pool[: kv_new.shape[0]] = kv_new
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = mla_decode(q_lat, q_pe, kv_pool, table, lens, page_size, V3_SCALE)
        assert torch.equal(out, eager), "replay differs from the eager launch on the same inputs"
        assert rel_err_rows(out, reference_decode(q_lat, q_pe, kv_pool, table, lens, page_size)) <= 2e-2


def test_mla_decode_flashinfer_cuda_graph_replay():
    """FACTS §3's recipe: fixed buffers, plan outside capture, capture run(), plan the real lengths, replay."""
    need("flashinfer")
    batch, heads, page_size, max_ctx = 8, 16, 64, 1024
    q_lat, q_pe, kv, table, lens = decode_case(batch, heads, page_size, max_ctx, torch.bfloat16, 1)
    dec = flashinfer_attention.FlashInferMLADecode(q_lat.device, graph_batch_size=batch, max_pages=table.shape[1])
    dec.plan(table, lens, heads, page_size, V3_SCALE, q_lat.dtype, kv.dtype)
    out = torch.empty_like(q_lat)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dec.run(q_lat, q_pe, kv, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.run(q_lat, q_pe, kv, out=out)

    lens.copy_(torch.tensor([1, 64, 65, 1024, 7, 500, 128, 999], device="cuda"))
    dec.plan(table, lens, heads, page_size, V3_SCALE, q_lat.dtype, kv.dtype)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err_rows(out, reference_decode(q_lat, q_pe, kv, table, lens, page_size)) <= 2e-2
