"""NextN speculation on a GPU with CUDA graphs over the draft steps, the verification pass and the draft extend:
greedy tokens in fp32 equal plain decoding's (and the CPU engine's), the graphs are what ran, pages go back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.cuda_graph import CudaGraphConfig
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kernels import ATTENTION_BACKENDS, MOE_BACKENDS
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.spec_decode import SpeculativeConfig

pytestmark = pytest.mark.gpu

TRAINED = Path(__file__).resolve().parents[1] / "models" / "tiny-trained"
PROMPTS = ["def parse_args(argv=None):\n    parser = argparse.", "import os\nimport sys\n\n\nclass ",
           "    for i in range(len(items)):\n        if ", "    return self._"]
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def run(model_dir, device, k=0, graphs=False, dtype="float32"):
    engine = LLMEngine(EngineConfig(str(model_dir), dtype=dtype, device=device, attention_backend="triton"
                                    if device == "cuda" else "torch", moe_backend="triton" if device == "cuda" else
                                    "torch", gemm_backend="torch", cache=CacheConfig(page_size=16, num_pages=256),
                                    cuda_graph=CudaGraphConfig(enabled=graphs, max_bs=8),
                                    speculative=SpeculativeConfig("NEXTN", k) if k else SpeculativeConfig()),
                       progress=lambda _: None)
    outs = [o.output_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert engine.kv_pages_in_use_by_requests() == 0
    return outs, engine


@pytest.fixture(scope="module")
def model_dir(tiny_v3_dir):
    if "triton" not in ATTENTION_BACKENDS or "triton" not in MOE_BACKENDS:
        pytest.skip("CUDA graphs need the triton backends")
    return TRAINED if (TRAINED / "config.json").exists() else tiny_v3_dir


@pytest.mark.parametrize("k", [1, 3])
def test_graphed_speculation_gives_plain_tokens_fp32(model_dir, k):
    cpu, _ = run(model_dir, "cpu")
    plain, _ = run(model_dir, "cuda", graphs=True)
    spec, engine = run(model_dir, "cuda", k=k, graphs=True)
    assert engine.runner.graphs is not None and engine.runner.mtp_graphs is not None, "graphs were not captured"
    assert engine.runner.graphs.replays > 0 and engine.runner.mtp_graphs.replays > 0, "graphs were not replayed"
    assert spec == plain == cpu
    if model_dir == TRAINED:
        assert engine.speculator.mean_accept_length > 1.5, "the trained MTP head should be accepted often"


def test_graphed_and_eager_speculation_agree_fp32(model_dir):
    eager, e = run(model_dir, "cuda", k=3, graphs=False)
    graphed, g = run(model_dir, "cuda", k=3, graphs=True)
    assert eager == graphed
    assert e.speculator.mean_accept_length == pytest.approx(g.speculator.mean_accept_length)
    torch.cuda.synchronize()
