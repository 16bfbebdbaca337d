"""FlashInfer MLA decode inside CUDA graphs (kernels/flashinfer_attention.py FlashInferGraphPlan): each graph owns
its FlashInfer plan, re-planned on the host before every replay. FlashInfer's MLA kernels exist for DeepSeek's
latent widths only (512 + 64; smaller test models fall back to Triton), so these tests build a dummy-weight model
with V3's attention widths and few, narrow layers. FlashInfer's MLA plan does not depend on graph mode, and every
batch here fills its bucket exactly, so graphed and eager decoding run the same kernels on the same partition:
their tokens must be identical."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.cuda_graph import CudaGraphConfig
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kernels import ATTENTION_BACKENDS, MOE_BACKENDS
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.spec_decode import SpeculativeConfig
from pdserve.tiny_model import tiny_config_dict

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7], list(range(10, 50)), [3] * 17, list(range(100, 180, 3))]  # 4 rows: bucket 4, no padding
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def v3_widths_dir(tmp_path_factory):
    if "flashinfer" not in ATTENTION_BACKENDS or "triton" not in MOE_BACKENDS:
        pytest.skip("needs the flashinfer attention and triton MoE backends")
    cfg = tiny_config_dict("deepseek_v3")
    cfg.update(hidden_size=1024, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=256,
               kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_hidden_layers=2)
    out = tmp_path_factory.mktemp("v3-widths")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def generate(model_dir, graphs: bool, k: int = 0):
    engine = LLMEngine(EngineConfig(str(model_dir), dtype="bfloat16", device="cuda", load_format="dummy",
                                    attention_backend="flashinfer", moe_backend="triton", gemm_backend="torch",
                                    cache=CacheConfig(page_size=16, num_pages=128),
                                    cuda_graph=CudaGraphConfig(enabled=graphs, max_bs=4),
                                    speculative=SpeculativeConfig("NEXTN", k) if k else SpeculativeConfig()),
                       progress=lambda _: None)
    outs = [o.output_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert engine.kv_pages_in_use_by_requests() == 0
    return outs, engine


def test_graphed_flashinfer_decode_gives_the_eager_tokens(v3_widths_dir):
    eager, _ = generate(v3_widths_dir, graphs=False)
    graphed, engine = generate(v3_widths_dir, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.replays > 0, "graphs were not captured or not replayed"
    assert graphs.graphs[4].plan is not None and graphs.graphs[4].plan.num_plans == 1, "FlashInfer was not planned"
    assert graphed == eager


def test_graphed_flashinfer_speculation_gives_the_eager_tokens(v3_widths_dir):
    """Verification (16 rows), draft extend and the two-step draft chain, whose steps attend with lens and lens + 1
    (one plan each), all replayed with FlashInfer."""
    eager, _ = generate(v3_widths_dir, graphs=False, k=3)
    graphed, engine = generate(v3_widths_dir, graphs=True, k=3)
    mtp = engine.runner.mtp_graphs
    assert mtp is not None and mtp.replays > 0 and engine.runner.graphs.replays > 0
    assert mtp.graphs[4].chain_plan is not None and mtp.graphs[4].chain_plan.num_plans == 2
    assert graphed == eager
