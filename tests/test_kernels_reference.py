"""The torch kernel backends against plain fp32 definitions, on fresh random inputs over ragged shapes.

GPU backends will be held to the same references (same functions, other backend names)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import ATTENTION_BACKENDS, GEMM_BACKENDS
from pdserve.kernels.attention import merge_state
from pdserve.kernels.backends import available_attention_backends
from pdserve.kernels.gemm import block_dequant, block_quant, per_token_group_quant


def naive_attention(q, k, v, causal, scale):
    """q (n, H, D), k (m, H, D), v (m, H, Dv) of one sequence; queries are the last n positions of the keys."""
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if causal:
        n, m = q.shape[0], k.shape[0]
        mask = torch.arange(m)[None, :] > (torch.arange(n)[:, None] + m - n)
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, -1)  # (H, n)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.double()), lse.T


@pytest.mark.parametrize("backend", available_attention_backends("cpu"))
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_prefill(backend, causal):
    attn = ATTENTION_BACKENDS.get(backend)()
    gen = torch.Generator().manual_seed(1)
    heads, dqk, dv = 3, 24, 16
    q_lens, kv_lens = [1, 7, 0, 13], [1, 9, 4, 13] if not causal else [1, 7, 0, 13]
    qo, kvo = [0], [0]
    for a, b in zip(q_lens, kv_lens):
        qo.append(qo[-1] + a)
        kvo.append(kvo[-1] + b)
    q = torch.randn(qo[-1], heads, dqk, generator=gen)
    k, v = torch.randn(kvo[-1], heads, dqk, generator=gen), torch.randn(kvo[-1], heads, dv, generator=gen)
    out, lse = attn.ragged_prefill(q, k, v, qo, kvo, causal, 0.3)
    for b in range(len(q_lens)):
        if q_lens[b] == 0:
            continue
        ref, ref_lse = naive_attention(q[qo[b]:qo[b + 1]], k[kvo[b]:kvo[b + 1]], v[kvo[b]:kvo[b + 1]], causal, 0.3)
        torch.testing.assert_close(out[qo[b]:qo[b + 1]].double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[qo[b]:qo[b + 1]].double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_merge_state_equals_attention_over_the_union():
    attn = ATTENTION_BACKENDS.get("torch")()
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, 2, 8, generator=gen)
    k, v = torch.randn(11, 2, 8, generator=gen), torch.randn(11, 2, 4, generator=gen)
    full, full_lse = attn.ragged_prefill(q, k, v, [0, 5], [0, 11], False, 0.5)
    a = attn.ragged_prefill(q, k[:6], v[:6], [0, 5], [0, 6], False, 0.5)
    b = attn.ragged_prefill(q, k[6:], v[6:], [0, 5], [0, 5], False, 0.5)
    out, lse = merge_state(*a, *b)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-6)
    # An empty side (lse -inf) leaves the other unchanged.
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    out2, lse2 = merge_state(*empty, out, lse)
    torch.testing.assert_close(out2, out)
    assert torch.equal(lse2, lse)


@pytest.mark.parametrize("backend", available_attention_backends("cpu"))
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mla_decode_paged(backend, page_size):
    attn = ATTENTION_BACKENDS.get(backend)()
    gen = torch.Generator().manual_seed(page_size)
    heads, rank, rope, num_pages = 5, 32, 8, 64
    kv = torch.randn(num_pages * page_size, rank + rope, generator=gen)
    seq_lens = [1, page_size + 3, 2 * page_size + 1, 37]
    perm = torch.randperm(num_pages, generator=gen).tolist()  # non-contiguous, unordered pages
    tables, used = [], 0
    for n in seq_lens:
        need = -(-n // page_size)
        tables.append(perm[used: used + need])
        used += need
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q_lat, q_pe = torch.randn(4, heads, rank, generator=gen), torch.randn(4, heads, rope, generator=gen)
    out = attn.mla_decode(q_lat, q_pe, kv, table, torch.tensor(seq_lens), page_size, 0.2)
    for b, n in enumerate(seq_lens):
        slots = [tables[b][i // page_size] * page_size + i % page_size for i in range(n)]
        lat = kv[slots]  # (n, rank + rope)
        k = lat[:, None, :].expand(n, heads, rank + rope)
        ref, _ = naive_attention(torch.cat([q_lat[b], q_pe[b]], -1)[None], k, lat[:, None, :rank].expand(n, heads, rank),
                                 False, 0.2)
        torch.testing.assert_close(out[b].double(), ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (200, 72), (7, 640)])
def test_block_quant_roundtrip(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    q, s = block_quant(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    back = block_dequant(q, s, (128, 128))
    # e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4 of its block's scale range.
    assert ((back - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-9).all()


@pytest.mark.parametrize("k", [128, 384, 640, 200])  # K/128 = 1, 3, 5 (not a multiple of 4), ragged
def test_fp8_linear_equals_dequantized_linear(k):
    gemm = GEMM_BACKENDS.get("torch")()
    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(9, k, generator=gen), torch.randn(300, k, generator=gen)
    q, s = block_quant(w)
    got = gemm.linear(x, q, s, (128, 128))
    torch.testing.assert_close(got, x @ block_dequant(q, s, (128, 128)).T, rtol=1e-5, atol=1e-4)


def test_per_token_group_quant():
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 10
    q, s = per_token_group_quant(x, 128)
    assert s.shape == (6, 3)
    back = q.float() * s.repeat_interleave(128, dim=1)[:, :300]
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-6).all()
