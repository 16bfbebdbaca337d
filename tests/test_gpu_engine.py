"""The engine on a GPU: greedy tokens of the tiny model equal the CPU reference engine's (fp32), with and without
CUDA graphs, for every GPU backend combination available; bf16 agrees where logits are not near-ties."""

from __future__ import annotations

import pytest
import torch

from pdserve.cuda_graph import CudaGraphConfig
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kernels import ATTENTION_BACKENDS, MOE_BACKENDS
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.scheduler import SchedulerConfig

pytestmark = pytest.mark.gpu

PROMPTS = ["The router sends each request to a prefill worker", "Hello", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. " * 4,
           [5, 6, 7]]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def run(model_dir, device, dtype="float32", attention="torch", moe="torch", gemm="torch", graphs=False, budget=2048):
    engine = LLMEngine(EngineConfig(str(model_dir), dtype=dtype, device=device, attention_backend=attention,
                                    moe_backend=moe, gemm_backend=gemm,
                                    cache=CacheConfig(page_size=16, num_pages=256),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                                    cuda_graph=CudaGraphConfig(enabled=graphs, max_bs=8)))
    outs = [o.output_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert engine.kv_pages_in_use_by_requests() == 0
    return outs, engine


@pytest.fixture(scope="module")
def cpu_reference(tiny_v3_dir):
    return run(tiny_v3_dir, "cpu")[0]


GPU_COMBOS = [(a, m) for a in ATTENTION_BACKENDS.names() for m in MOE_BACKENDS.names()]


@pytest.mark.parametrize("attention, moe", GPU_COMBOS)
def test_fp32_tokens_equal_cpu(tiny_v3_dir, cpu_reference, attention, moe):
    outs, _ = run(tiny_v3_dir, "cuda", "float32", attention, moe, "torch")
    assert outs == cpu_reference, f"{attention}/{moe}: GPU fp32 tokens differ from the CPU engine"


def test_cuda_graphs_give_the_eager_tokens(tiny_v3_dir, cpu_reference):
    if "triton" not in ATTENTION_BACKENDS or "triton" not in MOE_BACKENDS:
        pytest.skip("CUDA graphs need the triton backends")
    eager, _ = run(tiny_v3_dir, "cuda", "float32", "triton", "triton", "torch", graphs=False)
    graphed, engine = run(tiny_v3_dir, "cuda", "float32", "triton", "triton", "torch", graphs=True)
    assert engine.runner.graphs is not None, "graphs were not captured"
    assert graphed == eager == cpu_reference


def test_fp8_checkpoint_logits_on_gpu(tiny_v3_fp8_dir):
    """The FP8 checkpoint on the GPU (fp32 activations, FP8 weights dequantized by the kernels) gives the CPU
    reference's logits. (bf16 activations drift by up to 40% on this random tiny model, seen on an H100: its
    activations are badly conditioned, so bf16 is checked at real widths in the kernel tests instead.)"""
    from pdserve.forward_batch import ForwardBatch, ForwardMode

    logits = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32")):
        engine = LLMEngine(EngineConfig(str(tiny_v3_fp8_dir), dtype=dtype, device=device,
                                        cache=CacheConfig(page_size=16, num_pages=16)))
        ids = engine.encode(PROMPTS[0])
        pages = engine.pool.allocator.alloc(-(-len(ids) // 16))
        n = len(ids)
        batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(ids, device=device), torch.arange(n, device=device),
                             engine.pool.slots_for(pages, 0, n).to(device), 16, qo_indptr=[0, n], prefix_lens=[0],
                             page_tables=[pages])
        logits[device] = engine.model.logits(engine.model(batch, engine.pool.kv)).float().cpu()
    err = ((logits["cuda"] - logits["cpu"]).abs().max() / logits["cpu"].abs().max()).item()
    print(f"GPU vs CPU logits on the FP8 tiny model (fp32): max rel err {err:.2e}")
    assert err < 1e-3


def test_overlap_scheduling_under_cuda_graphs_gives_the_in_order_tokens(tiny_v3_dir, trained_model_dir):
    """Decode steps launched before the previous one is read (placeholders resolved on the device before each graph
    replay): the tokens of the in-order engine, fp32 on the tiny model with stops, seeds and a late arrival, and bf16
    on the demo model (same batch shapes both ways, so the same rounding)."""
    from test_overlap import PROMPTS as OVERLAP_PROMPTS, run as run_script

    if "triton" not in ATTENTION_BACKENDS or "triton" not in MOE_BACKENDS:
        pytest.skip("CUDA graphs need the triton backends")

    def engine(model_dir, dtype, overlap):
        return LLMEngine(EngineConfig(str(model_dir), dtype=dtype, device="cuda", attention_backend="triton",
                                      moe_backend="triton", gemm_backend="torch", overlap_schedule=overlap,
                                      cache=CacheConfig(page_size=16, num_pages=256),
                                      cuda_graph=CudaGraphConfig(enabled=True, max_bs=8)))

    sampled = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)
    stop_at = run(tiny_v3_dir, "cpu")[0][0][5]
    script = {0: [("add", "greedy", OVERLAP_PROMPTS[0], GREEDY), ("add", "sampled", OVERLAP_PROMPTS[1], sampled),
                  ("add", "stops", OVERLAP_PROMPTS[0], SamplingParams(max_new_tokens=24, stop_token_ids=(stop_at,)))],
              4: [("add", "late", OVERLAP_PROMPTS[3], GREEDY)]}
    for model_dir, dtype in ((tiny_v3_dir, "float32"), (trained_model_dir, "bfloat16")):
        in_order, overlapped = engine(model_dir, dtype, False), engine(model_dir, dtype, True)
        expected, got = run_script(in_order, script), run_script(overlapped, script)
        assert overlapped.runner.graphs is not None and overlapped.runner.graphs.replays > 0
        assert overlapped.num_overlapped_steps > 0 and in_order.num_overlapped_steps == 0
        assert got == expected, f"{dtype}: overlap scheduling changed the tokens"
        assert overlapped.kv_pages_in_use_by_requests() == 0 and not overlapped.has_unfinished
