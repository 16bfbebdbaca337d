"""Tensor parallelism on two GPUs (NCCL): a TP2 engine, built as `pdserve generate --tp 2` builds it (the GPU's own
kernels, CUDA graphs capturing the all-reduce), gives the single-GPU engine's greedy tokens: on the trained demo
model identical in fp32 and in bf16 as close to fp32 as the single GPU's; on the V3 slice (real widths, block-FP8 dummy
weights) identical in fp32, with each expert split (TP), with the experts split (EP) and with attention data-parallel
over the requests (DP attention). (In bf16 the dummy weights' logits are too flat for a greedy token to survive
another summation order, so the V3 slice is compared in fp32.) Every test is bounded: a collective that waits past
--collective-timeout fails, and a test that runs past TEST_LIMIT_S ends the run with every thread's stack."""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest
import torch

from pdserve.cli import build_parser
from pdserve.cli.engine_args import engine_config_from_args
from pdserve.engine import LLMEngine
from pdserve.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
TEST_LIMIT_S = float(os.environ.get("PDSERVE_TEST_LIMIT_S", 240))  # each test well under it (two V3 slice engines)


@pytest.fixture(autouse=True)
def bounded():
    """NOTE: a hang inside NCCL blocks the main thread in C, where no Python-level timeout reaches it;
    faulthandler's watchdog thread dumps every stack and exits the process instead (the ranks follow their parent)."""
    faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def engine(model_dir: str, tp: int, *extra: str) -> LLMEngine:
    args = build_parser().parse_args(["generate", "--model", model_dir, "--device", "cuda", "--tp", str(tp),
                                      "--num-pages", "512", "--collective-timeout", "60", *extra])
    return LLMEngine(engine_config_from_args(args), progress=lambda _m: None)


def tokens(model_dir: str, tp: int, prompts, *extra: str) -> list[list[int]]:
    e = engine(model_dir, tp, *extra)
    try:
        return [o.output_ids for o in e.generate(prompts, GREEDY)]
    finally:
        e.close()


@pytest.fixture(scope="module")
def v3_slice(tmp_path_factory) -> str:
    sys.path.insert(0, ROOT)
    from benchmarks.bench_serving import write_v3_config

    return write_v3_config(str(tmp_path_factory.mktemp("v3")), 4)


def random_prompts(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(8, 600, (count,), generator=g)]


@pytest.mark.parametrize("extra", [(), ("--dp-attention",)], ids=["tp2", "dp-attention"])
def test_tp2_gives_the_single_gpu_tokens_in_fp32_on_the_trained_model(trained_model_dir, extra):
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 20, list(range(300, 317))]
    want = tokens(str(trained_model_dir), 1, prompts, "--dtype", "float32")
    assert tokens(str(trained_model_dir), 2, prompts, "--dtype", "float32", *extra) == want


@pytest.mark.parametrize("extra", [(), ("--dp-attention",)], ids=["tp2", "dp-attention"])
def test_prefilled_requests_join_a_tp2_engine_in_fp32(trained_model_dir, extra):
    """A decode worker's way in on two GPUs: prompts a single-GPU engine computed land in rank 0's pool and join
    with their first tokens; under TP their KV is copied to rank 1 over NCCL, under DP attention moved to the least
    loaded rank's pool; the single-GPU tokens, every pool idle afterwards (tests/test_tp_engine.py's check)."""
    from test_tp_engine import check_prefilled_requests_join

    single = engine(str(trained_model_dir), 1, "--dtype", "float32")
    parallel = engine(str(trained_model_dir), 2, "--dtype", "float32", *extra)
    try:
        check_prefilled_requests_join(single, parallel)
    finally:
        parallel.close()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_tp2_in_bf16_keeps_the_fp32_tokens_about_as_long_as_one_gpu_does(trained_model_dir):
    """A bf16 greedy sequence leaves fp32's at the first step whose two best logits are closer than bf16's rounding;
    TP2 rounds once more (each rank's partial sums, all-reduced in bf16), so it may leave on other prompts, but it
    keeps about as many of the fp32 tokens in all as the single GPU does."""
    prompts = random_prompts(16, 1000)
    exact = tokens(str(trained_model_dir), 1, prompts, "--dtype", "float32")
    bf16 = {tp: tokens(str(trained_model_dir), tp, prompts, "--dtype", "bfloat16") for tp in (1, 2)}
    kept = {tp: sum(map(common_prefix, got, exact)) for tp, got in bf16.items()}
    print(f"bf16 tokens before the first departure from fp32, of {16 * GREEDY.max_new_tokens}: "
          f"TP1 {kept[1]}, TP2 {kept[2]}; TP2 = TP1 on {sum(a == b for a, b in zip(bf16[1], bf16[2]))} of 16 prompts")
    assert kept[2] >= 0.9 * kept[1]


@pytest.fixture(scope="module")
def v3_slice_tp1(v3_slice):
    """The single-GPU tokens on the V3 slice (fp32, torch kernels), computed once for every split below."""
    prompts = random_prompts(4, 120000)
    return prompts, tokens(v3_slice, 1, prompts, *V3_FP32)


V3_FP32 = ["--load-format", "dummy", "--max-model-len", "1024", "--dtype", "float32", "--attention-backend", "torch",
           "--moe-backend", "torch", "--gemm-backend", "torch"]


@pytest.mark.parametrize("extra", [(), ("--ep", "2"), ("--dp-attention",), ("--dp-attention", "--ep", "2")],
                         ids=["tp2", "ep2", "dp-attention", "dp-attention-ep2"])
def test_tp2_gives_the_single_gpu_tokens_in_fp32_on_the_v3_slice(v3_slice, v3_slice_tp1, extra):
    prompts, want = v3_slice_tp1
    assert tokens(v3_slice, 2, prompts, *V3_FP32, *extra) == want
