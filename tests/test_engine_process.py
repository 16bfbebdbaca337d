"""A decode worker whose engine runs in a process of its own (`pdserve decode --engine-process on`):
pdserve/serving/engine_link.py, decode_service/engine_side.py.

Through the real stack (router, prefill and decode worker processes): greedy tokens equal the single-process engine's
with NextN speculation, alone and batched; what the engine process records (the speculation histograms, the pool
gauge) reaches the worker's one /metrics; health and GetLoad answer while the engine is in a slow forward; an engine
process that dies fails the requests on it with UNAVAILABLE and takes the worker down (exit 1) instead of leaving a
port that accepts work nobody runs; a stopped worker leaves no engine process behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine import EngineConfig, LLMEngine, RequestOutput
from pdserve.kv_cache import CacheConfig
from pdserve.kv_transfer import KVTransferError
from pdserve.sampling import SamplingParams
from pdserve.serving.engine_link import pack_items, portable_error, unpack_items
from pdserve.serving.grpc_shell import ServiceError
from pdserve.serving.metrics import Metrics, MetricsRecorder
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from stack import generate, metric, scrape, start_stack, wait_idle
from test_spec_decode import PROMPTS

GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True)
NEXTN = ["--dtype", "float32", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"]


def engine_process_of(worker_pid: int) -> int:
    """The decode worker's engine process: its spawned child (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    raise AssertionError(f"worker {worker_pid} has no engine process (children {children})")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# ---- without processes ------------------------------------------------------------------------------------------------
def test_outputs_and_errors_cross_as_they_were():
    """A step's items survive the pipe's packing; a running request's output_ids stay behind (they grow with every
    token; the gRPC side reads a finished request's alone)."""
    running = RequestOutput("a", [7, 8], "xy", False, [1, 2, 7, 8], None, 5, 2)
    done = RequestOutput("b", [9], "z", True, [3, 9], "length", 4, 0)
    kv = KVTransferError("timeout", "room 3 waited 300 s")
    kv.transport = "tcp"
    back = unpack_items(pack_items([("a", running), ("b", done), ("c", kv),
                                    ("d", ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))]))
    assert back[0] == ("a", RequestOutput("a", [7, 8], "xy", False, [], None, 5, 2))
    assert back[1] == ("b", done)
    err = back[2][1]
    assert isinstance(err, KVTransferError) and (err.kind, err.message, err.transport) == ("timeout",
                                                                                          "room 3 waited 300 s", "tcp")
    assert back[3][1].code == grpc.StatusCode.RESOURCE_EXHAUSTED and str(back[3][1]) == "full"


def test_an_error_that_cannot_cross_becomes_internal():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}{b}")

    err = portable_error(Odd(1, 2))
    assert isinstance(err, ServiceError) and err.code == grpc.StatusCode.INTERNAL


def test_what_an_engine_process_records_lands_in_the_workers_registry():
    rec, metrics = MetricsRecorder(), Metrics.create("decode")
    rec.running.set(3)
    rec.running.set(5)  # a gauge crosses once, with its last value
    rec.count(rec.step_hold_seconds, 0.25)
    rec.count(rec.transfer_failures, kind="timeout", transport="tcp")
    rec.spec_accept_length.observe(3)
    ops = rec.take()
    assert len(ops) == 4 and rec.take() == []
    metrics.apply(ops)
    value = metrics.registry.get_sample_value
    assert value("pdserve_num_running_reqs", {"role": "decode"}) == 5
    assert value("pdserve_decode_step_hold_seconds_total", {"role": "decode"}) == 0.25
    assert value("pdserve_kv_transfer_failures_total", {"role": "decode", "kind": "timeout", "transport": "tcp"}) == 1
    assert value("pdserve_spec_accept_length_sum", {"role": "decode"}) == 3
    with pytest.raises(AttributeError, match="no metric 'runing'"):
        rec.runing.set(1)


# ---- through the stack ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(trained_model_dir, tmp_path_factory):
    s = start_stack(trained_model_dir, tmp_path_factory.mktemp("logs-engine-process"), engine_args=NEXTN,
                    decode_args=["--engine-process", "on"])
    yield s
    s.stop()


@pytest.mark.slow
def test_greedy_tokens_through_an_engine_process_are_the_single_process_engines(trained_model_dir, stack):
    engine = LLMEngine(EngineConfig(str(trained_model_dir), dtype="float32",
                                    cache=CacheConfig(page_size=4, num_pages=512)))
    want = [o.output_ids for o in engine.generate(PROMPTS, GREEDY)]
    address = stack.router.address
    for prompt, ids in zip(PROMPTS, want):
        got = generate(address, prompt, GREEDY)
        assert got.output_ids == ids and got.streamed_ids == ids and got.finish_reason == "length"
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched on the decode worker
        assert list(pool.map(lambda p: generate(address, p, GREEDY).output_ids, PROMPTS)) == want

    decode = stack.decode[0]
    assert "engine in a process of its own" in decode.log()
    load = wait_idle(decode)  # GetLoad: a call into the engine process
    assert load.num_free_pages == load.num_total_pages
    text = scrape(decode)
    assert metric(decode.metrics_port, "pdserve_spec_accept_length_count") > 0  # recorded in the engine process
    assert "pdserve_kv_pool_usage_ratio" in text and metric(decode.metrics_port, "pdserve_kv_pool_usage_ratio") == 0
    assert metric(decode.metrics_port, "pdserve_generation_tokens_total") >= 2 * len(PROMPTS) * GREEDY.max_new_tokens
    with grpc.insecure_channel(decode.address) as ch:  # Abort: a call into the engine process too
        assert not pb_grpc.DecodeWorkerStub(ch).Abort(pb.AbortRequest(request_id="nobody"), timeout=5).found


@pytest.mark.slow
def test_health_and_load_answer_while_the_engine_process_is_in_a_slow_forward_and_a_stop_ends_it(trained_model_dir,
                                                                                                  tmp_path):
    stack = start_stack(trained_model_dir, tmp_path, engine_args=["--skip-warmup"],
                        decode_args=["--engine-process", "on", "--test-hook-slow-first-forward", "4"],
                        router_args=["--skip-warmup"])
    decode = stack.decode[0]
    try:
        child = engine_process_of(decode.popen.pid)
        done = threading.Event()
        threading.Thread(target=lambda: (generate(stack.router.address, [5, 6, 7, 8], SamplingParams(
            max_new_tokens=3, ignore_eos=True)), done.set()), daemon=True).start()
        time.sleep(1.0)  # the prompt was prefilled; the decode engine is in its first forward now
        worst = 0.0
        with grpc.insecure_channel(decode.address) as ch:
            health, worker = health_pb2_grpc.HealthStub(ch), pb_grpc.DecodeWorkerStub(ch)
            for _ in range(5):
                t0 = time.monotonic()
                health.Check(health_pb2.HealthCheckRequest(), timeout=3)
                worker.GetLoad(pb.GetLoadRequest(), timeout=3)
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.2)
        assert not done.is_set(), "the engine was not busy during the checks: the test checked nothing"
        assert worst < 0.25, f"health + GetLoad took {worst * 1e3:.0f} ms while the engine was busy"
        assert done.wait(30)
    finally:
        stack.stop()
    # A stopped worker (SIGTERM: its drain, then its engine process told to stop) leaves no engine process.
    assert decode.popen.returncode == 0
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


@pytest.mark.slow
def test_a_dead_engine_process_fails_its_requests_and_stops_the_worker(trained_model_dir, tmp_path):
    stack = start_stack(trained_model_dir, tmp_path, decode_args=["--engine-process", "on"])
    try:
        decode = stack.decode[0]
        child = engine_process_of(decode.popen.pid)
        result: dict = {}

        def long_request() -> None:
            try:
                result["out"] = generate(stack.router.address, [5, 6, 7, 8],
                                         SamplingParams(max_new_tokens=2000, ignore_eos=True), timeout=60)
            except grpc.RpcError as e:
                result["code"] = e.code()

        t = threading.Thread(target=long_request, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while metric(decode.metrics_port, "pdserve_generation_tokens_total") < 20:  # decoding on it now
            assert time.monotonic() < deadline and t.is_alive(), f"the request never started decoding: {result}"
            time.sleep(0.05)
        os.kill(child, signal.SIGKILL)
        t.join(20)
        assert result.get("code") == grpc.StatusCode.UNAVAILABLE, result
        assert decode.popen.wait(20) == 1
        assert "engine" in decode.log() and "exited" in decode.log()
    finally:
        stack.stop()
