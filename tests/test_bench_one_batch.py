"""benchmarks/bench_one_batch.py's --rank-of: rank 0 of a TP-N worker built alone, its collectives skipped, holds
that rank's shards and runs a forward of the right shapes (the GPU run times it beside the single-GPU model)."""

from __future__ import annotations

import sys

import torch

from stack import REPO

sys.path.insert(0, str(REPO))

from benchmarks.bench_one_batch import rank_group  # noqa: E402
from pdserve.config import ModelConfig  # noqa: E402
from pdserve.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from pdserve.kernels import KernelBackends  # noqa: E402
from pdserve.kv_cache import CacheConfig, LatentKVPool  # noqa: E402
from pdserve.tiny_model import tiny_config_dict  # noqa: E402
from pdserve.weights import load_model  # noqa: E402


def _model(size: int, ep: bool = False):
    cfg = ModelConfig.from_hf_dict(tiny_config_dict("deepseek_v3"), name="tiny")
    kernels = KernelBackends.create("torch", "torch", "torch")
    return cfg, load_model(None, cfg, torch.float32, kernels, "dummy", "cpu", tp=rank_group(size), ep=ep)


def _weights(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_a_rank_alone_holds_its_shards_and_runs_a_prompt():
    cfg, whole = _model(1)
    _, rank = _model(2)
    _, expert_rank = _model(2, ep=True)
    assert rank.tp.size == 2 and _weights(rank) < _weights(whole)
    mla, mla_whole = rank.layers[0].self_attn, whole.layers[0].self_attn
    assert mla.num_heads * 2 == mla_whole.num_heads
    moe = next(layer.mlp for layer in expert_rank.layers if cfg.is_moe_layer(layer.layer_idx))
    assert moe.w13.shape[0] * 2 == cfg.n_routed_experts
    pool = LatentKVPool(cfg.num_kv_layers, cfg.kv_cache_dim, CacheConfig(16, 4), torch.float32, "cpu")
    n = 12
    batch = ForwardBatch(ForwardMode.EXTEND, torch.randint(0, 100, (n,)), torch.arange(n),
                         pool.slots_for([0], 0, n), 16, qo_indptr=[0, n], prefix_lens=[0], page_tables=[[0]])
    for model in (rank, expert_rank):
        hidden = model(batch, pool.kv)
        assert hidden.shape == (n, cfg.hidden_size) and torch.isfinite(hidden).all()
        assert model.logits(hidden[-1:]).shape == (1, cfg.vocab_size)
