"""The disaggregated path with tensor-parallel workers (CPU, Gloo, fp32): a prefill worker of 2 ranks ships the KV
its rank 0 holds to a decode worker of 2 ranks with DP attention, whose rank 0 receives it and moves each request's
KV to the rank it runs on (the least loaded; under plain TP it hands every rank a copy, tests/test_tp_engine.py),
and the tokens are the single-process engine's. Workers of any split count as the same model (their fingerprints
match), so a router pairs a TP1 worker with a TP2 one."""

from __future__ import annotations

import types

import pytest

import torch

from pdserve.cli import build_parser
from pdserve.cli.up import engine_flags
from pdserve.config import ModelConfig
from pdserve.kernels import KernelBackends
from pdserve.parallel.group import TPGroup
from pdserve.serving.worker_common import model_fingerprint
from pdserve.weights import build_model

from golden import check_against_reference, reference_outputs
from stack import start_stack, wait_idle

FP32_CPU = ["--dtype", "float32", "--device", "cpu", "--tp", "2"]


@pytest.mark.slow
def test_tp2_prefill_and_dp_attention_decode_workers_give_the_single_process_tokens(trained_model_dir, tmp_path):
    reference = reference_outputs(trained_model_dir, dtype="float32")
    stack = start_stack(trained_model_dir, tmp_path, engine_args=FP32_CPU, decode_args=["--dp-attention"],
                        timeout_s=180)
    try:
        check_against_reference(stack.router.address, reference)
        for worker in stack.prefill + stack.decode:
            idle = wait_idle(worker)  # (a DP-attention worker counts every rank's pool)
            assert idle.num_free_pages == idle.num_total_pages == 512 * (2 if worker in stack.decode else 1), idle
            assert "tensor-parallel ranks ready: 2" in worker.log()
    finally:
        stack.stop()


def test_workers_of_any_split_have_one_fingerprint(trained_model_dir):
    cfg = ModelConfig.from_model_dir(str(trained_model_dir))

    def fingerprint(tp: TPGroup, ep: bool = False) -> str:  # what model_fingerprint reads of an engine
        model = build_model(cfg, torch.bfloat16, KernelBackends.create(), device="meta", tp=tp, ep=ep)
        return model_fingerprint(types.SimpleNamespace(model_config=cfg, config=types.SimpleNamespace(
            load_format="auto"), model=model))

    assert fingerprint(TPGroup()) == fingerprint(TPGroup(0, 2)) == fingerprint(TPGroup(1, 4)) == \
        fingerprint(TPGroup(1, 2), ep=True)


def test_up_hands_tp_and_ep_to_its_workers():
    flags = engine_flags(build_parser().parse_args(["up", "--model", "m", "--tp", "2", "--ep", "2"]))
    assert flags[flags.index("--tp") + 1] == "2" and flags[flags.index("--ep") + 1] == "2"
