"""Stack layouts on one GPU that the serving benchmark does not run: several prefill and decode workers sharing the
GPU, and one pair with its KV coming over tcp and over cuda_ipc. Each is held to the single-process engine's greedy
tokens (fp32, the torch backends: on the GPU these equal the CPU reference, tests/test_gpu_engine.py). Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from golden import check_against_reference, check_concurrently, reference_outputs
from stack import metric, start_stack, wait_idle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP32_ON_GPU = ["--dtype", "float32", "--attention-backend", "torch", "--moe-backend", "torch", "--device", "cuda:0"]
START_S = 240  # workers on one GPU start side by side, each loading the model and warming up


def test_two_prefill_and_two_decode_workers_share_one_gpu(trained_model_dir, tmp_path):
    """2 prefill + 2 decode workers on cuda:0, KV over cuda_ipc between every pair: the reference's tokens one
    request at a time and 32 at once, both prefill workers used, every pool back to idle."""
    reference = reference_outputs(trained_model_dir, dtype="float32")
    stack = start_stack(trained_model_dir, tmp_path, n_prefill=2, n_decode=2,
                        engine_args=[*FP32_ON_GPU, "--kv-transport", "auto"],
                        router_args=["--balance-threshold", "1"], timeout_s=START_S)
    try:
        check_against_reference(stack.router.address, reference)
        check_concurrently(stack.router.address, reference)
        for p in stack.prefill:
            assert metric(p.metrics_port, "pdserve_requests_total", outcome="finished") > 0, "a prefill worker idled"
            assert metric(p.metrics_port, "pdserve_kv_transfer_bytes_total", transport="cuda_ipc") > 0
            assert metric(p.metrics_port, "pdserve_kv_transfer_bytes_total", transport="tcp") == 0
        for proc in stack.prefill + stack.decode:
            idle = wait_idle(proc)
            assert idle.num_free_pages == idle.num_total_pages, f"{proc.role} {proc.address} holds pages: {idle}"
    finally:
        stack.stop()


@pytest.mark.parametrize("transport", ["tcp", "cuda_ipc"])
def test_a_decode_worker_on_the_gpu_takes_its_kv_over(trained_model_dir, tmp_path, transport):
    """A pair on cuda:0: the decode worker's pool is where the KV lands (over tcp through the host, or written by
    the prefill worker over cuda_ipc), and the tokens are the reference's."""
    reference = reference_outputs(trained_model_dir, dtype="float32")
    stack = start_stack(trained_model_dir, tmp_path, engine_args=[*FP32_ON_GPU, "--kv-transport", transport],
                        timeout_s=START_S)
    try:
        check_against_reference(stack.router.address, reference)
        decode = stack.decode[0]
        prefill_port = stack.prefill[0].metrics_port
        assert metric(prefill_port, "pdserve_kv_transfer_bytes_total", transport=transport) > 0
        idle = wait_idle(decode)
        assert idle.num_free_pages == idle.num_total_pages
    finally:
        stack.stop()
