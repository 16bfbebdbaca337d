"""Workers on any GPU, and prefill and decode on separate GPUs of one host: the engine on the last GPU gives cuda:0's
greedy tokens; a prefill worker on cuda:0 and a decode worker on cuda:1 give the single-process engine's tokens over
every transport (fp32, the torch backends: on the GPU these equal the CPU reference, tests/test_gpu_engine.py), move
their KV over the transport asked for, and end with every page free. Skipped without two GPUs."""

from __future__ import annotations

import subprocess
import sys
import pytest
import torch

from golden import GREEDY, PROMPTS, check_against_reference, check_concurrently, reference_outputs
from stack import metric, start_stack, wait_idle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

FP32 = ["--dtype", "float32", "--attention-backend", "torch", "--moe-backend", "torch"]
START_S = 240


def test_the_engine_on_the_last_gpu_gives_the_tokens_of_cuda0(trained_model_dir):
    """The default kernels (Triton RMSNorm/RoPE among them, which launch on the current device) on cuda:N."""
    from pdserve.engine import EngineConfig, LLMEngine

    last = torch.cuda.device_count() - 1
    outputs = {}
    for device in ("cuda:0", f"cuda:{last}"):
        engine = LLMEngine(EngineConfig(model_dir=str(trained_model_dir), device=device, attention_backend="triton",
                                        moe_backend="triton", gemm_backend="triton"))
        assert engine.pool.kv.device == torch.device(device)
        outputs[device] = [o.output_ids for o in engine.generate(PROMPTS, GREEDY)]
        del engine
        torch.cuda.empty_cache()
    assert outputs["cuda:0"] == outputs[f"cuda:{last}"]


def test_pdserve_generate_runs_on_the_last_gpu(trained_model_dir):
    last = torch.cuda.device_count() - 1
    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--model", str(trained_model_dir),
                          "--device", f"cuda:{last}", "--input-ids", "5,6,7", "--max-new-tokens", "4", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"output_ids"' in out.stdout


@pytest.mark.parametrize("transport", ["auto", "nccl", "tcp"])
def test_prefill_on_gpu0_and_decode_on_gpu1_give_the_engines_tokens(trained_model_dir, tmp_path, transport):
    """One request at a time, then 32 at once; the KV moved over the transport asked for (auto: cuda_ipc across
    the GPUs, never tcp); every pool idle after."""
    reference = reference_outputs(trained_model_dir, dtype="float32")
    stack = start_stack(trained_model_dir, tmp_path, engine_args=[*FP32, "--device", "cuda:0", "--kv-transport",
                                                                  transport],
                        decode_args=["--device", "cuda:1"], timeout_s=START_S)
    try:
        check_against_reference(stack.router.address, reference)
        check_concurrently(stack.router.address, reference)
        moved = "cuda_ipc" if transport == "auto" else transport
        port = stack.prefill[0].metrics_port
        assert metric(port, "pdserve_kv_transfer_bytes_total", transport=moved) > 0
        if moved != "tcp":
            assert metric(port, "pdserve_kv_transfer_bytes_total", transport="tcp") == 0
        for proc in stack.prefill + stack.decode:
            idle = wait_idle(proc)
            assert idle.num_free_pages == idle.num_total_pages, f"{proc.role} {proc.address} holds pages: {idle}"
    finally:
        stack.stop()
