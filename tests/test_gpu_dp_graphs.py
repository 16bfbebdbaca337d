"""DP attention's decode graphs on one GPU: a graph runner with the DP layout at one rank (its static per-rank
padding, the gathers of every layer and the step's rows picked back out of the gathered output, all captured)
replays the same hidden states and logits as the plain graphs of the same bucket, and as the eager forward, on
the same rows. The rank collectives themselves run on two GPUs (tests/test_gpu_tp.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.cuda_graph import CudaGraphConfig, DecodeGraphRunner
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kernels import ATTENTION_BACKENDS, MOE_BACKENDS
from pdserve.kv_cache import CacheConfig
from pdserve.model_runner import ModelRunner
from pdserve.parallel.group import TPGroup
from pdserve.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_dp_layout_graphs_replay_the_plain_graphs_rows(trained_model_dir):
    if "triton" not in ATTENTION_BACKENDS or "triton" not in MOE_BACKENDS:
        pytest.skip("CUDA graphs need the triton backends")
    config = CudaGraphConfig(max_bs=8)
    engine = LLMEngine(EngineConfig(str(trained_model_dir), dtype="float32", device="cuda", attention_backend="triton",
                                    moe_backend="triton", gemm_backend="torch",
                                    cache=CacheConfig(page_size=16, num_pages=256), cuda_graph=config,
                                    overlap_schedule=False),  # (every row's last token read on the host)
                       progress=lambda _m: None)
    for prompt in ([5, 6, 7], list(range(40, 90)), [9] * 20):  # three requests mid-decode, KV in their pages
        engine.add_request(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    reqs = list(engine.scheduler.running)
    assert len(reqs) == 3
    plain = engine.runner
    max_pages = plain.graphs.max_pages
    dp_graphs = DecodeGraphRunner(engine.model, engine.pool, max_pages, config, dp=TPGroup(0, 1))
    dp = ModelRunner(engine.model, engine.pool, engine.pool.kv.device, graphs=dp_graphs)
    rows = plain.decode_rows(reqs)
    h_plain, l_plain = (t.clone() for t in plain._replay(plain.graphs, rows))
    h_dp, l_dp = dp._replay(dp_graphs, rows)
    assert dp_graphs.replays == 1 and h_dp.shape == h_plain.shape
    assert torch.equal(h_dp, h_plain) and torch.equal(l_dp, l_plain)
    h_eager = engine.model(plain.rows_batch(rows), engine.pool.kv)
    torch.testing.assert_close(h_dp, h_eager, rtol=1e-5, atol=1e-5)
