"""The disaggregated path with tensor-parallel workers (CPU, Gloo, fp32): a prefill worker of 2 ranks ships the KV
its rank 0 holds to a decode worker of 2 ranks with DP attention, whose rank 0 receives it and moves each request's
KV to the rank it runs on (the least loaded; under plain TP it hands every rank a copy, tests/test_tp_engine.py),
and the tokens are the single-process engine's. Workers of any split count as the same model (their fingerprints
match), so a router pairs a TP1 worker with a TP2 one."""

from __future__ import annotations

import os
import re
import signal
import types

import grpc
import pytest

import torch

from pdserve.cli import build_parser
from pdserve.cli.up import engine_flags
from pdserve.config import ModelConfig
from pdserve.kernels import KernelBackends
from pdserve.parallel.group import TPGroup
from pdserve.sampling import SamplingParams
from pdserve.serving.worker_common import model_fingerprint
from pdserve.weights import build_model

from golden import check_against_reference, reference_outputs
from stack import generate, start_stack, wait_idle

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


def test_a_served_tp_worker_whose_rank_hangs_ends_itself(trained_model_dir, tmp_path):
    """Rank 1 of the prefill worker stopped (alive, so nothing notices it died): the next prompt's collective waits
    --collective-timeout, then the worker ends (exit status 1, saying why) rather than failing every later step,
    and the router answers the prompt with an error instead of hanging."""
    stack = start_stack(trained_model_dir, tmp_path, engine_args=FP32_CPU[:-2],
                        prefill_args=["--tp", "2", "--collective-timeout", "2"], timeout_s=180)
    rank1 = None
    try:
        prefill = stack.prefill[0]
        rank1 = int(re.search(r"tensor-parallel rank 1 of 2 started \(pid (\d+)", prefill.log_path.read_text())[1])
        os.kill(rank1, signal.SIGSTOP)
        with pytest.raises(grpc.RpcError):
            generate(stack.router.address, [5, 6, 7, 8], SamplingParams(max_new_tokens=4), timeout=30)
        prefill.popen.wait(30)
        assert prefill.popen.returncode == 1, prefill.log()
        assert ("prefill-engine: this worker cannot go on: a step of the 2 tensor-parallel ranks failed on rank 0 "
                "with every rank still running") in prefill.log(), prefill.log()
    finally:
        if rank1 is not None:
            os.kill(rank1, signal.SIGKILL)
        stack.stop()
