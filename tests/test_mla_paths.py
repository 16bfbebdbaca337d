"""The two MLA paths check each other: non-absorbed MHA prefill (with the cached prefix decompressed in chunks) and
absorbed decode over the paged latent cache must give the same logits for the same tokens."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.kv_cache import CacheConfig


@pytest.fixture(scope="module")
def engine(tiny_v3_dir):
    # prefix_chunk_tokens=3: a cached prefix is attended in several chunks merged by log-sum-exp.
    return LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=64),
                                  prefix_chunk_tokens=3))


def _scattered_pages(engine, n_tokens):
    """A non-contiguous, unordered page table, so slot arithmetic is really exercised."""
    alloc = engine.pool.allocator
    pages = alloc.alloc(2 * -(-n_tokens // engine.pool.page_size))
    keep, spare = pages[::-2], pages[-2::-2]
    alloc.decref(spare)
    return keep


def _extend(engine, tokens, pages, start, end):
    pool = engine.pool
    batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(tokens[start:end]), torch.arange(start, end),
                         pool.slots_for(pages, start, end), pool.page_size, qo_indptr=[0, end - start],
                         prefix_lens=[start], page_tables=[pages])
    return engine.model.logits(engine.model(batch, pool.kv))  # (end - start, vocab)


def _decode(engine, tokens, pages, pos):
    pool = engine.pool
    batch = ForwardBatch(ForwardMode.DECODE, torch.tensor([tokens[pos]]), torch.tensor([pos]),
                         pool.slots_for(pages, pos, pos + 1), pool.page_size,
                         page_table=pool.page_table_tensor([pages]), seq_lens=torch.tensor([pos + 1]))
    return engine.model.logits(engine.model(batch, pool.kv))[0]


TOKENS = [3, 99, 47, 250, 11, 11, 300, 8, 64, 128, 5, 77, 400, 23, 9, 42, 17, 256, 31]


def test_absorbed_decode_matches_non_absorbed_prefill(engine):
    pages = _scattered_pages(engine, len(TOKENS))
    full = _extend(engine, TOKENS, pages, 0, len(TOKENS))  # non-absorbed, every position
    split = 6
    _extend(engine, TOKENS, pages, 0, split)
    worst = 0.0
    for pos in range(split, len(TOKENS)):  # absorbed, one token at a time over the paged latent cache
        got = _decode(engine, TOKENS, pages, pos)
        worst = max(worst, (got - full[pos]).abs().max().item())
    print(f"absorbed vs non-absorbed: max abs logit diff {worst:.3e}")
    assert worst < 1e-4
    engine.pool.allocator.decref(pages)


def test_chunked_prefix_attention_matches_one_shot(engine):
    """A prompt computed in three extend chunks (each attending to the cached prefix in 3-token chunks) gives
    the logits of a one-shot prefill."""
    pages = _scattered_pages(engine, len(TOKENS))
    full = _extend(engine, TOKENS, pages, 0, len(TOKENS))
    parts = [_extend(engine, TOKENS, pages, a, b) for a, b in ((0, 5), (5, 13), (13, len(TOKENS)))]
    diff = (torch.cat(parts) - full).abs().max().item()
    print(f"chunked prefill vs one-shot: max abs logit diff {diff:.3e}")
    assert diff < 1e-4
    engine.pool.allocator.decref(pages)


def test_absorbed_weights_are_the_split_kv_b_proj(engine):
    attn = engine.model.layers[0].self_attn
    w = attn.kv_b_proj.weight.view(attn.num_heads, attn.nope_dim + attn.v_dim, attn.rank)
    assert torch.equal(attn.w_uk, w[:, : attn.nope_dim]) and torch.equal(attn.w_uv, w[:, attn.nope_dim:])
