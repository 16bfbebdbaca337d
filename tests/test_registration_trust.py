"""Forged entries in Redis (real redis-server, real workers and router with --internal-token): the router never
dials a forged registration's address, so it never sends it the token or traffic, and never routes by a prefix
owner the worker did not sign; it counts and logs each one, and the legitimate workers keep serving."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.common.blocks import block_hashes
from pdserve.sampling import SamplingParams

from redis_server import RedisServer
from stack import generate, start_stack
from test_serving_redis import counters, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs Debian's redis-server")]
TOKEN = "internal-s3cret"
THREE = SamplingParams(max_new_tokens=3, ignore_eos=True)


class CallRecorder(grpc.GenericRpcHandler):
    """An attacker's gRPC server: records every call that reaches it (method, metadata) and implements nothing."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def service(self, details):
        self.calls.append((details.method, dict(details.invocation_metadata)))
        return None


@pytest.fixture(scope="module")
def signed(tiny_v3_dir, tmp_path_factory):
    """(stack, redis): one prefill and one decode worker and a router, all with the internal token, on Redis."""
    with RedisServer() as redis:
        token = ["--internal-token", TOKEN]
        stack = start_stack(tiny_v3_dir, tmp_path_factory.mktemp("logs-trust"), engine_args=token,
                            redis_url=redis.url, router_args=token)
        try:
            yield stack, redis
        finally:
            stack.stop()


def test_forged_registrations_get_no_token_and_no_traffic(signed):
    stack, redis = signed
    evil = CallRecorder()
    server = grpc.server(ThreadPoolExecutor(2), handlers=[evil])
    evil_address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
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
        server.stop(0)


def test_prefix_owners_not_signed_by_a_worker_are_skipped_and_counted(signed):
    """The prefill worker signs its claims on blocks; owners written by anyone else (unsigned, a made-up signature,
    bytes no worker writes) on a fresh prompt's first block are never routed by (load decides), never an error to the
    client, and are counted and logged; the worker's own signed claim then routes the prompt back to it."""
    stack, redis = signed
    c = redis.client()
    try:
        prompt = [300 + i for i in range(12)]  # nobody has sent it: nobody owns its blocks
        first = f"pdserve:blk:{block_hashes(prompt, 4)[0].hex()}"
        assert not c.exists(first)
        c.sadd(first, "prefill-0", b"\xff\xfe", "prefill-0|" + "0" * 64)
        before = counters(stack.router, "pdserve_router_decisions_total", "reason")
        assert len(generate(stack.router.address, prompt, THREE).output_ids) == 3
        after = counters(stack.router, "pdserve_router_decisions_total", "reason")
        assert after.get("prefix_hit", 0) == before.get("prefix_hit", 0), (before, after)
        assert after["load"] == before.get("load", 0) + 1
        rejected = counters(stack.router, "pdserve_prefix_ownership_rejected_total", "reason")
        assert rejected.get("unsigned", 0) >= 1 and rejected.get("signature", 0) >= 1 \
            and rejected.get("malformed", 0) >= 1, rejected
        assert stack.router.log().count("ignoring prefix-ownership entries that are not signed") == 1
        # The worker's own claim, signed: "prefill-0|" and an HMAC of the block and its id (published off its engine
        # thread, so waited for).
        forged = b"prefill-0|" + b"0" * 64
        claims = lambda: [m for m in c.smembers(first) if m.startswith(b"prefill-0|") and m != forged]  # noqa: E731
        (claim,) = wait_until(claims, 5, "the worker's signed claim")
        assert len(claim) == len("prefill-0|") + 64
        assert len(generate(stack.router.address, prompt, THREE).output_ids) == 3
        again = counters(stack.router, "pdserve_router_decisions_total", "reason")
        assert again["prefix_hit"] == after.get("prefix_hit", 0) + 1, (after, again)
    finally:
        c.close()
