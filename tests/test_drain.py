"""Graceful drain on SIGTERM, with real processes: health turns NOT_SERVING, new requests are refused with
UNAVAILABLE, the request in flight finishes with all its tokens, and the process exits 0."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from stack import load, start, start_stack
from test_faults import one

pytestmark = pytest.mark.slow
LONG = 200  # tokens: a couple of seconds on the CPU


def health(address: str) -> str:
    with grpc.insecure_channel(address) as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as e:
            return e.code().name


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def first_tokens_then(address, prompt, decode):
    """Start a long request in the background; return its future once the decode worker is running it (so the
    router has it in flight: a fixed sleep is not enough on a loaded machine)."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(one, address, prompt, LONG)
    wait_for(lambda: future.done() or load(decode).num_running_requests > 0, 20, "the request to start decoding")
    assert not future.done(), future.result()
    return future


def test_router_and_decode_drain_on_sigterm(tiny_v3_dir, tmp_path):
    stack = start_stack(tiny_v3_dir, tmp_path, decode_args=["--drain-timeout", "20"],
                        router_args=["--drain-timeout", "20"])
    router2 = None
    try:
        # The router: the request in flight completes, a new one is refused, exit status 0.
        inflight = first_tokens_then(stack.router.address, [5, 6, 7], stack.decode[0])
        stack.router.popen.send_signal(signal.SIGTERM)
        wait_for(lambda: health(stack.router.address) == "NOT_SERVING", 2, "router NOT_SERVING")
        assert one(stack.router.address, [8, 9], 2)[0] == "UNAVAILABLE"
        assert inflight.result(timeout=30)[0] == "OK"
        assert stack.router.popen.wait(10) == 0

        # A decode worker, behind a fresh router.
        router2 = start("router", ["--model", str(tiny_v3_dir), "--prefill", stack.prefill[0].address,
                                   "--decode", stack.decode[0].address], tmp_path, "router2")
        decode = stack.decode[0]
        inflight = first_tokens_then(router2.address, [5, 6, 7, 8], decode)
        decode.popen.send_signal(signal.SIGTERM)
        wait_for(lambda: health(decode.address) == "NOT_SERVING", 2, "decode NOT_SERVING")
        with grpc.insecure_channel(decode.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.DecodeWorkerStub(ch).Reserve(pb.ReserveRequest(request_id="late", input_ids=[5]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
        assert one(router2.address, [8, 9], 2)[0] == "UNAVAILABLE"  # the only decode worker is leaving
        status, streamed, _ = inflight.result(timeout=30)
        assert (status, streamed) == ("OK", LONG)
        assert decode.popen.wait(10) == 0

        stack.prefill[0].popen.send_signal(signal.SIGTERM)  # idle: exits at once
        assert stack.prefill[0].popen.wait(10) == 0
    finally:
        stack.stop()
        if router2 is not None:
            router2.stop()
