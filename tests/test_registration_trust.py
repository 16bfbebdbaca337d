"""Forged worker registrations in Redis (real redis-server, real workers and router with --internal-token): the
router never dials a forged address, so it never sends it the token or traffic, counts and logs each one, and the
legitimate workers keep serving."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.sampling import SamplingParams

from redis_server import RedisServer
from stack import generate, start_stack
from test_serving_redis import counters

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs Debian's redis-server")]
TOKEN = "internal-s3cret"


class CallRecorder(grpc.GenericRpcHandler):
    """An attacker's gRPC server: records every call that reaches it (method, metadata) and implements nothing."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def service(self, details):
        self.calls.append((details.method, dict(details.invocation_metadata)))
        return None


def test_forged_registrations_get_no_token_and_no_traffic(tiny_v3_dir, tmp_path):
    evil = CallRecorder()
    server = grpc.server(ThreadPoolExecutor(2), handlers=[evil])
    evil_address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    with RedisServer() as redis:
        token = ["--internal-token", TOKEN]
        stack = start_stack(tiny_v3_dir, tmp_path, engine_args=token, redis_url=redis.url, router_args=token)
        try:
            c = redis.client()
            real = json.loads(c.get("pdserve:worker:decode:decode-0"))
            # What the attacker wrote, and a copy of the real entry pointing elsewhere.
            c.set("pdserve:worker:decode:zz-evil", json.dumps({"worker_id": "zz-evil", "role": "decode",
                                                              "address": evil_address}), px=60000)
            c.set("pdserve:worker:prefill:zz-moved", json.dumps({**real, "worker_id": "zz-moved", "role": "prefill",
                                                                "address": evil_address}), px=60000)
            deadline = time.monotonic() + 4.0  # the router re-reads the registry every second
            n = 0
            while time.monotonic() < deadline:
                got = generate(stack.router.address, [5 + n % 20, 6, 7], SamplingParams(max_new_tokens=3,
                                                                                          ignore_eos=True))
                assert len(got.output_ids) == 3
                n += 1
            assert evil.calls == [], f"the router called the forged address: {evil.calls[:3]}"
            assert real.get("signature") and real.get("signed_at"), f"the worker's entry is not signed: {real}"
            rejected = counters(stack.router, "pdserve_worker_registrations_rejected_total", "reason")
            assert rejected.get("unsigned", 0) >= 2 and rejected.get("signature", 0) >= 2, rejected
            log = stack.router.log()
            # One warning per kind of forgery a minute, naming an example, not one per entry or per refresh.
            assert log.count("ignoring worker registrations that are not signed, e.g. pdserve:worker:") == 1, log
            c.close()
        finally:
            stack.stop()
            server.stop(0)
