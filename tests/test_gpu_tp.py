"""Tensor parallelism on two GPUs (NCCL): a TP2 engine, built as `pdserve generate --tp 2` builds it (the GPU's own
kernels, CUDA graphs), gives the single-GPU engine's greedy tokens: identical in fp32 on the trained demo model,
on at least 15 of 16 prompts on the V3 slice (real widths, block-FP8 dummy weights, bf16), with each expert split
(TP) and with the experts split (EP)."""

from __future__ import annotations

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


def engine(model_dir: str, tp: int, *extra: str) -> LLMEngine:
    args = build_parser().parse_args(["generate", "--model", model_dir, "--device", "cuda", "--tp", str(tp),
                                      "--num-pages", "512", *extra])
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


def test_tp2_gives_the_single_gpu_tokens_in_fp32_on_the_trained_model(trained_model_dir):
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 20, list(range(300, 317))]
    want = tokens(str(trained_model_dir), 1, prompts, "--dtype", "float32")
    assert tokens(str(trained_model_dir), 2, prompts, "--dtype", "float32") == want


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_tp2_gives_the_single_gpu_greedy_tokens_on_the_v3_slice(v3_slice, ep):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 120000, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 600, (16,), generator=g)]
    dummy = ["--load-format", "dummy", "--max-model-len", "1024"]
    want = tokens(v3_slice, 1, prompts, *dummy)
    got = tokens(v3_slice, 2, prompts, *dummy, *(["--ep", "2"] if ep else []))
    same = sum(a == b for a, b in zip(got, want))
    print(f"{'EP2' if ep else 'TP2'} vs TP1 on the V3 slice: {same} of {len(prompts)} prompts identical")
    assert same >= 15
