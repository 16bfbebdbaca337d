"""Ready means ready: a worker warms up before it reports SERVING, leaves its engine as it was, answers health and
load checks while its engine thread is busy, and a stack whose first forward is slow (a cold GPU compiling kernels,
played by the test hooks PDTEST_PREFILL_SLOW_FIRST_FORWARD_S and PDTEST_DECODE_SLOW_FIRST_FORWARD_S of
tests/hooks/sitecustomize.py) serves requests sent the moment `pdserve up` says it is up."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine import EngineConfig, LLMEngine, StepHooks
from pdserve.kv_cache import CacheConfig
from pdserve.prefill_service.engine import PrefillEngine
from pdserve.sampling import SamplingParams
from pdserve.serving.warmup import WarmupPlan, plan_for, warm_up
from pdserve.spec_decode import SpeculativeConfig
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from stack import REPO, free_port, generate, hooks_env, scrape, start_stack

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
# A plan with every phase (GPU-like, small): prompts of 1 token, one chunk and a chunk and a bit (chunked), several
# prompts in one step, decode batches, a prompt joining decoding requests.
FULL_PLAN = WarmupPlan(prompt_lens=(1, 17, 32, 49), prompt_batch=4, split_prompt_len=21, decode_batches=(1, 2, 4),
                       decode_tokens=5, mixed=True)


def engine_for(model_dir, speculate: bool = False) -> LLMEngine:
    from pdserve.scheduler import SchedulerConfig

    return LLMEngine(EngineConfig(str(model_dir), cache=CacheConfig(page_size=4, num_pages=128),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=32),
                                  speculative=SpeculativeConfig("NEXTN" if speculate else None, 2)))


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "nextn"])
def test_warmup_leaves_the_engine_as_it_was(tiny_v3_dir, speculate):
    """No request, no page, no prefix-cache block left; and the engine then generates what a fresh one does."""
    fresh = engine_for(tiny_v3_dir, speculate)
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, seed=3)]
    want = [o.output_ids for o in fresh.generate(PROMPTS, params)]

    engine = engine_for(tiny_v3_dir, speculate)
    free = engine.pool.allocator.num_free
    said = []
    report = warm_up(engine, FULL_PLAN, said.append)
    assert report.requests == 4 + 4 + 3 + 1 + 2 + 4 + 3 and report.steps > 0
    assert len(said) == len(report.phases) == 10 and all(s.startswith("warm-up: ") for s in said)
    assert not engine.has_unfinished and engine.kv_pages_in_use_by_requests() == 0
    assert engine.pool.allocator.num_free == free and engine.prefix_cache.num_cached_pages == 0
    assert [o.output_ids for o in engine.generate(PROMPTS, params)] == want


def test_warmup_keeps_the_tiers_hooks_out(tiny_v3_dir):
    """A tier's step hooks (the prefill worker ships KV from them) see none of the warm-up's requests, and are back
    afterwards."""
    engine = engine_for(tiny_v3_dir)

    class Recording(StepHooks):
        computes_mtp_kv = True
        seen: list = []

        def on_layer_done(self, prompts, layer):
            self.seen.append(layer)

        def on_prefilled(self, prompts, first_tokens, hidden):
            self.seen.append("prefilled")

    hooks = engine.hooks = Recording()
    warm_up(engine, FULL_PLAN)
    assert engine.hooks is hooks and hooks.seen == []


def test_a_speculating_prefill_workers_warmup_computes_the_mtp_kv_of_every_prompt_and_ships_nothing(tiny_v3_dir):
    """The hand-over's one-token MTP forward at each prompt's last position (attention over the whole prompt) runs
    for every warm-up prompt, as for a real one: on a GPU its kernels compile before the first request, not in it."""
    engine = engine_for(tiny_v3_dir, speculate=True)
    prefill = PrefillEngine(engine, sender=None)
    computed = []
    mtp_decode = engine.runner.mtp_decode

    def recording(reqs, next_tokens, hidden):
        computed.extend(r.num_prompt_tokens for r in reqs)
        return mtp_decode(reqs, next_tokens, hidden)

    engine.runner.mtp_decode = recording
    report = warm_up(engine, FULL_PLAN)  # (its decode batches and mixed step too: a prefill worker's never run them)
    assert sorted(computed) == sorted([1, 17, 32, 49] + [17] * 4 + [21] * 3 + [17] * (1 + 2 + 4) + [17] * 3)
    assert report.requests == len(computed)
    assert engine.hooks is prefill and not prefill.records  # nothing shipped, nothing held
    plain = PrefillEngine(engine_for(tiny_v3_dir), sender=None)  # no MTP-layer KV: nothing more to compute
    assert not plain.compute_only().computes_mtp_kv


def test_cpu_plans_are_one_short_prompt_and_one_decode_step(tiny_v3_dir):
    engine = engine_for(tiny_v3_dir)
    assert plan_for(engine, "prefill") == WarmupPlan(prompt_lens=(4,), decode_tokens=2)
    assert plan_for(engine, "decode") == WarmupPlan(decode_batches=(1,), decode_tokens=2)


def _cuda_engine_stub(max_model_len: int, spec_steps: int = 0):
    """What plan_for reads of an engine, as a CUDA one with default graphs would have it."""
    from types import SimpleNamespace

    from pdserve.cuda_graph import CudaGraphConfig
    from pdserve.scheduler import SchedulerConfig

    sched = SchedulerConfig(max_num_batched_tokens=2048, max_running_requests=128, max_model_len=max_model_len)
    spec = SpeculativeConfig("NEXTN", spec_steps) if spec_steps else SpeculativeConfig()
    return SimpleNamespace(scheduler=SimpleNamespace(config=sched),
                           config=SimpleNamespace(device="cuda", speculative=spec, cuda_graph=CudaGraphConfig()),
                           pool=SimpleNamespace(allocator=SimpleNamespace(num_free=5000), page_size=16))


def test_gpu_plans_cover_chunks_graph_buckets_and_eager_batches():
    engine = _cuda_engine_stub(4096)
    prefill, decode, alone = (plan_for(engine, role) for role in ("prefill", "decode", "engine"))
    assert prefill.prompt_lens == (1, 17, 2048, 2065) and prefill.prompt_batch == 8 and not prefill.mixed
    # Every captured bucket (1, 2, 4, 8, then every 8 up to 64) and 128, above the graphs (eager).
    assert decode.decode_batches == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128) and decode.prompt_lens == (1,)
    assert alone.mixed and alone.decode_batches == decode.decode_batches
    assert plan_for(_cuda_engine_stub(1024), "prefill").prompt_lens == (1, 17, 1023)  # the context caps the chunk
    # ... and a prompt split across steps beside others comes from 3 prompts of 1041 tokens (2048 // 2 + 17), or of
    # the longest the context allows (1023: the third is split, 2 of its tokens in the first step).
    assert prefill.split_prompt_len == 1041 and decode.split_prompt_len == 0 and alone.split_prompt_len == 1041
    assert plan_for(_cuda_engine_stub(1024), "prefill").split_prompt_len == 1023
    assert plan_for(_cuda_engine_stub(600), "prefill").split_prompt_len == 0  # 3 x 599 fit one step: no split
    assert plan_for(_cuda_engine_stub(4096, spec_steps=3), "decode").decode_tokens == 10  # a full NextN round


def test_warmup_refuses_a_busy_engine(tiny_v3_dir):
    engine = engine_for(tiny_v3_dir)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine, FULL_PLAN)


def _timed(call) -> float:
    t0 = time.monotonic()
    call()
    return time.monotonic() - t0


@pytest.mark.slow
def test_health_and_load_are_answered_while_the_engine_is_busy(tiny_v3_dir, tmp_path):
    """The prefill worker's engine thread spends 4 s in its first forward; meanwhile its health checks and GetLoad
    (the router's heartbeat) answer in milliseconds."""
    # (The router skips its warm-up too: its request through the pair would take the slow first forward. Only the
    # prefill worker is slowed: the checks are its own, and a slow decode forward after them would add its seconds
    # to the test and nothing to what it checks.)
    stack = start_stack(tiny_v3_dir, tmp_path, engine_args=["--skip-warmup"], router_args=["--skip-warmup"],
                        prefill_env=hooks_env(PDTEST_PREFILL_SLOW_FIRST_FORWARD_S=4))
    try:
        done = threading.Event()
        result = {}

        def request() -> None:
            result["out"] = generate(stack.router.address, [5, 6, 7, 8], SamplingParams(max_new_tokens=3,
                                                                                        ignore_eos=True))
            done.set()

        threading.Thread(target=request, daemon=True).start()
        prefill = stack.prefill[0]
        time.sleep(0.5)  # the prompt is in the engine's first forward now
        health_s, load_s = [], []
        with grpc.insecure_channel(prefill.address) as ch:
            health, worker = health_pb2_grpc.HealthStub(ch), pb_grpc.PrefillWorkerStub(ch)
            for _ in range(5):
                health_s.append(_timed(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=3)))
                load_s.append(_timed(lambda: worker.GetLoad(pb.GetLoadRequest(), timeout=3)))
                time.sleep(0.2)
        assert not done.is_set(), "the engine was not busy during the checks: the test checked nothing"
        print(f"health {max(health_s) * 1e3:.1f} ms, GetLoad {max(load_s) * 1e3:.1f} ms at most while busy")
        assert max(health_s) < 0.25 and max(load_s) < 0.25
        assert done.wait(30) and result["out"].completion_tokens == 3
        ttft_s = re.search(r"^pdserve_time_to_first_token_seconds_sum(?:{[^}]*})? (\S+)$", scrape(prefill), re.M)
        assert float(ttft_s.group(1)) >= 4, "the prefill worker's own first forward was not the slow one"
    finally:
        stack.stop()


def _bench_args(target: str, n: int) -> argparse.Namespace:
    from pdserve.cli.bench import add_bench_args

    p = argparse.ArgumentParser()
    add_bench_args(p)
    return p.parse_args(["--target", target, "--num-prompts", str(n), "--max-concurrency", "32", "--input-len", "24",
                         "--output-len", "8", "--request-timeout", "60", "--no-progress"])


@pytest.mark.slow
def test_cold_start_serves_requests_sent_the_moment_it_is_up(trained_model_dir, tmp_path):
    """`pdserve up` on the demo model, each worker's first forward slowed by 2 s (a cold GPU compiling kernels): 32
    requests, all at once, sent as soon as it prints "pdserve is up", all succeed."""
    from pdserve.cli.bench import run

    port = free_port()
    log = tmp_path / "up.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           **hooks_env(PDTEST_PREFILL_SLOW_FIRST_FORWARD_S=2, PDTEST_DECODE_SLOW_FIRST_FORWARD_S=2)}
    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--model", str(trained_model_dir), "--port",
                           str(port), "--device", "cpu", "--http-port", "0", "--metrics-port", "0"], cwd=REPO,
                          stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while "pdserve is up" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        result = asyncio.run(run(_bench_args(f"127.0.0.1:{port}", 32)))
        text = log.read_text()
        assert result["failed"] == 0, (result["errors_by_status"], result["error_examples"], text[-3000:])
        assert result["completed"] == 32
        assert text.count("warm-up: done in") == 2  # both workers warmed up before reporting ready
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)
