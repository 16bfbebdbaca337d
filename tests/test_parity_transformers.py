"""Parity with the reference implementation: checkpoints written by transformers itself, loaded by pdserve.

Logits must agree within float32 rounding for a ragged batch of prompts, and greedy continuations of 32 tokens must
be identical (pdserve's continuous batching, chunked prefill and absorbed decode vs transformers' generate).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve.config import ModelConfig  # noqa: E402
from pdserve.engine import EngineConfig, LLMEngine  # noqa: E402
from pdserve.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from pdserve.kv_cache import CacheConfig  # noqa: E402
from pdserve.sampling import SamplingParams  # noqa: E402
from pdserve.scheduler import SchedulerConfig  # noqa: E402

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
              n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=1024,
              initializer_range=0.12, eos_token_id=1, bos_token_id=0)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

CASES = {
    "v3-q_lora-yarn": ("v3", dict(q_lora_rank=40, n_group=4, topk_group=2, rope_parameters=YARN)),
    "v3-no_q_lora": ("v3", dict(q_lora_rank=None, n_group=4, topk_group=2,
                                rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "v3-rotate_half-default_rope": ("v3", dict(q_lora_rank=40, n_group=2, topk_group=1, rope_interleave=False,
                                               rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    "v2-greedy": ("v2", dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2, rope_parameters=YARN)),
    "v2-group_limited": ("v2", dict(q_lora_rank=40, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                    n_shared_experts=1, routed_scaling_factor=1.5, rope_parameters=YARN)),
}
PROMPTS = [[5, 17, 3, 250, 42], [7] * 3 + list(range(100, 110)), list(range(20, 49))]


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_checkpoint(request, tmp_path_factory):
    arch, extra = CASES[request.param]
    torch.manual_seed(0)
    if arch == "v3":
        config = transformers.DeepseekV3Config(**COMMON, **extra)
        model = transformers.DeepseekV3ForCausalLM(config)
        for layer in model.model.layers[config.first_k_dense_replace:]:
            # A non-zero correction bias so that biased selection vs unbiased weights is exercised.
            layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(config.n_routed_experts) * 0.2)
    else:
        config = transformers.DeepseekV2Config(**COMMON, **extra)
        model = transformers.DeepseekV2ForCausalLM(config)
    path = tmp_path_factory.mktemp(request.param)
    model.eval().save_pretrained(path)
    return request.param, path, model


def _pdserve_logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One ragged EXTEND forward over all prompts; returns every position's logits per prompt."""
    pool, qo = engine.pool, [0]
    pages, slots, positions = [], [], []
    for p in prompts:
        req_pages = pool.allocator.alloc(-(-len(p) // pool.page_size))
        pages.append(req_pages)
        slots.append(pool.slots_for(req_pages, 0, len(p)))
        positions.append(torch.arange(len(p)))
        qo.append(qo[-1] + len(p))
    batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(sum(prompts, [])), torch.cat(positions), torch.cat(slots),
                         pool.page_size, qo_indptr=qo, prefix_lens=[0] * len(prompts), page_tables=pages)
    logits = engine.model.logits(engine.model(batch, pool.kv))
    for p in pages:
        pool.allocator.decref(p)
    return [logits[qo[i]: qo[i + 1]] for i in range(len(prompts))]


def test_logits_match_transformers(hf_checkpoint):
    name, path, hf = hf_checkpoint
    engine = LLMEngine(EngineConfig(str(path), cache=CacheConfig(page_size=4, num_pages=128)))
    ours = _pdserve_logits(engine, PROMPTS)
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float()
        diff = (got - want).abs().max().item()
        rel = diff / want.abs().max().item()
        print(f"{name} prompt_len={len(prompt)}: max abs diff {diff:.3e}, rel {rel:.3e}")
        assert rel < 2e-5, f"{name}: logits differ from transformers by {diff:.3e} (rel {rel:.3e})"


def test_greedy_continuations_match_transformers(hf_checkpoint):
    name, path, hf = hf_checkpoint
    # A small step budget forces chunked prefill, and a small page size makes page tables span many pages.
    engine = LLMEngine(EngineConfig(str(path), cache=CacheConfig(page_size=4, num_pages=128),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=12)))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.output_ids == ref[0, len(prompt):].tolist(), f"{name}: greedy tokens differ for {prompt}"
    assert engine.kv_pages_in_use_by_requests() == 0


def test_config_styles_agree(hf_checkpoint):
    """transformers 5's config (rope_parameters, rope_interleave) read the same as DeepSeek's own style."""
    name, path, _ = hf_checkpoint
    new_style = ModelConfig.from_model_dir(str(path))
    raw = dict(new_style.extra)
    params = dict(raw.pop("rope_parameters"))
    interleave = raw.pop("rope_interleave", True)
    if not interleave:
        pytest.skip("DeepSeek's own config style has no rope_interleave=false")
    raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    raw["rope_scaling"] = params if params["type"] != "default" else None
    old_style = ModelConfig.from_hf_dict(raw, name=new_style.name)
    assert old_style.rope == new_style.rope
    assert old_style.softmax_scale == new_style.softmax_scale
