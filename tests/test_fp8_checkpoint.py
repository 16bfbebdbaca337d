"""A block-FP8 checkpoint is kept in FP8 with its scales and gives the greedy tokens of its dequantized twin."""

from __future__ import annotations

import torch

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kernels.gemm import FP8_DTYPE
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.tiny_model import dequantized_twin

PROMPTS = ["The router sends each request", "Hello, world!", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000."]


def test_fp8_checkpoint_matches_dequantized_twin(tiny_v3_fp8_dir, tmp_path):
    twin_dir = dequantized_twin(str(tiny_v3_fp8_dir), str(tmp_path / "twin"))
    fp8 = LLMEngine(EngineConfig(str(tiny_v3_fp8_dir), cache=CacheConfig(page_size=4, num_pages=128)))
    twin = LLMEngine(EngineConfig(twin_dir, cache=CacheConfig(page_size=4, num_pages=128)))

    # Weights stay FP8 in memory, with fp32 block scales; router, norms, embeddings stay in full precision.
    attn = fp8.model.layers[0].self_attn
    moe = fp8.model.layers[1].mlp
    assert attn.q_a_proj.weight.dtype == FP8_DTYPE and attn.q_a_proj.weight_scale_inv.dtype == torch.float32
    assert moe.w13.dtype == FP8_DTYPE and moe.w13_scale_inv.shape[1:] == (2, 1)
    assert moe.gate.weight.dtype == torch.float32 and fp8.model.lm_head.weight.dtype == torch.float32
    assert twin.model_config.fp8 is None and twin.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.float32

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    got = [o.output_ids for o in fp8.generate(PROMPTS, params)]
    want = [o.output_ids for o in twin.generate(PROMPTS, params)]
    assert got == want
