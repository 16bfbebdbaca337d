"""The router's gRPC intake, with real processes: a prompt of 16 million token ids is refused from its size before
it is parsed (parsing it held the event loop every other client waits on), and a decode worker that released a
reservation before the router's attach came (NOT_FOUND) has the request retried on another worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pdserve.sampling import SamplingParams

from stack import REPO, generate, hooks_env, metric, start, start_all, start_stack, stop_all
from stream_gaps import max_gap

pytestmark = pytest.mark.slow


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def token_ids_request(n: int) -> bytes:
    """A GenerateRequest of n token ids (5: one byte each) as bytes, built without protobuf's encoder."""
    ids = b"\x0a" + varint(n) + b"\x05" * n  # TokenizedInput.input_ids, packed
    return b"\x1a" + varint(len(ids)) + ids  # GenerateRequest.tokenized


def test_16m_token_ids_are_refused_from_their_size_while_other_clients_stream(trained_model_dir, tmp_path):
    stack = start_stack(trained_model_dir, tmp_path)
    try:
        address = stack.router.address
        big = token_ids_request(16_000_000)
        streams = subprocess.Popen([sys.executable, str(REPO / "tests" / "stream_gaps.py"), address, "4", "6"],
                                   stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        time.sleep(3.0)  # the streams are under way: a baseline of their gaps before the big ones come
        results: list[tuple[str, str, float]] = []

        def send_big() -> None:
            with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 32 << 20)]) as ch:
                call = ch.unary_stream("/pdserve.v1.Generation/Generate")  # bytes as they are
                t = time.monotonic()
                try:
                    list(call(big, timeout=30))
                    results.append(("OK", "", time.monotonic() - t))
                except grpc.RpcError as e:
                    results.append((e.code().name, e.details(), time.monotonic() - t))

        senders = [threading.Thread(target=send_big) for _ in range(3)]  # three at once (each parsed in turn)
        t0 = time.monotonic()
        for s in senders:
            s.start()
        for s in senders:
            s.join()
        t1 = time.monotonic()
        out = json.loads(streams.communicate(timeout=60)[0])
        assert out["ended"] == ["OK"] * 4, out["ended"]
        during = max(max_gap(a, t0, t1 + 0.2) for a in out["arrivals"])
        before = max(max_gap(a, t0 - 1.5, t0 - 0.05) for a in out["arrivals"])
        print(f"16M ids x3 refused in {[round(r[2], 2) for r in results]} s; other streams' longest gap "
              f"{during * 1000:.0f} ms meanwhile, {before * 1000:.0f} ms in the 1.5 s before")
        # (A loaded machine stretches every gap: the streams' own gaps just before are the yardstick there.)
        assert during < max(0.3, 1.5 * before), (during, before)
        assert [r[0] for r in results] == ["INVALID_ARGUMENT"] * 3, results
        assert results[0][1].startswith("tokenized.input_ids: 16000005 bytes of token ids are more than the model's "
                                        "context of 2048 tokens can hold (a prompt may have at most 2047 ids"), results
    finally:
        stack.stop()


def test_a_reservation_released_before_its_attach_is_retried_on_another_decode_worker(trained_model_dir, tmp_path):
    """decode-1 releases every reservation before the router's attach can come (a router whose loop was held up
    past the attach deadline): each request routed there is refused at attach with NOT_FOUND, and retried on
    decode-0, never failed."""
    common = ["--model", str(trained_model_dir), "--page-size", "4", "--num-pages", "512"]
    workers = start_all([("prefill", [*common, "--worker-id", "prefill-0"], "prefill-0"),
                         ("decode", [*common, "--worker-id", "decode-0"], "decode-0"),
                         ("decode", [*common, "--worker-id", "decode-1"], "decode-1",
                          hooks_env(PDTEST_DECODE_ATTACH_DEADLINE_S=0))], tmp_path)
    try:
        router = start("router", ["--model", str(trained_model_dir), "--prefill", workers[0].address,
                                  "--decode", workers[1].address, "--decode", workers[2].address], tmp_path, "router")
        workers.append(router)
        for i in range(8):
            got = generate(router.address, [5 + i, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True))
            assert len(got.output_ids) == 4
        assert "had released the reservation when it was attached" in router.log()  # decode-1 was tried: refused
        assert metric(router.metrics_port, "pdserve_router_decisions_total", reason="retry") >= 1
        assert metric(workers[1].metrics_port, "pdserve_requests_total", outcome="finished") >= 8
    finally:
        stop_all(workers)
