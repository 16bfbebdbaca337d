"""The router warms every prefill/decode pair's KV path (router/warm_pairs.py) before it serves: one request of its
own through each pair, so that no client request pays for a pair's connection; kept out of the router's metrics."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from pdserve.common.values import KVLayout
from pdserve.router.warm_pairs import cold_pairs, warm_pairs
from pdserve.router.workers import Worker, WorkerPool
from pdserve.sampling import SamplingParams
from pdserve.serving.rpc_convert import layout_to_proto
from pdserve.v1 import worker_pb2 as pb

from stack import generate, scrape, start_stack


def sample(text: str, name: str) -> float:
    """The sum of a metric's samples on a /metrics page (0 where it has none)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.slow
def test_every_pair_is_warm_before_the_router_serves(tiny_v3_dir, tmp_path):
    stack = start_stack(tiny_v3_dir, tmp_path, n_prefill=1, n_decode=2)
    try:
        # Ready: each decode worker has already received a prompt's KV from the prefill worker and finished it.
        for d in stack.decode:
            page = scrape(d)
            assert sample(page, "pdserve_requests_total") == 1 and sample(page, "pdserve_generation_tokens_total") >= 1
        # The prefill worker counts a transfer once the decode worker confirmed it, which may come a moment later.
        deadline = time.monotonic() + 5
        while sample(scrape(stack.prefill[0]), "pdserve_kv_transfer_seconds_count") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sample(scrape(stack.prefill[0]), "pdserve_kv_transfer_seconds_count") == 2
        assert "warmed the KV path of 2 of 2 prefill/decode pairs" in stack.router.log()
        router = scrape(stack.router)  # the router's own requests are not client traffic
        assert sample(router, "pdserve_requests_total") == 0
        assert sample(router, "pdserve_time_to_first_token_seconds_count") == 0
        out = generate(stack.router.address, [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(out.output_ids) == 4
        # The router counts a request as its stream ends, a moment after the client read the complete message.
        deadline = time.monotonic() + 5
        while sample(scrape(stack.router), "pdserve_requests_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sample(scrape(stack.router), "pdserve_requests_total") == 1
    finally:
        stack.stop()


def _worker(address: str, role: str, layout: KVLayout) -> Worker:
    w = Worker(address, role, channel=None, stub=None, healthy=True)
    w.info = pb.WorkerInfo(address=address, layout=layout_to_proto(layout))
    return w


def test_a_pair_is_cold_until_warmed_and_again_once_a_worker_went_down():
    layout = KVLayout("m", page_size=4, num_kv_layers=2, kv_dim=8, dtype="bfloat16")
    other = KVLayout("m", page_size=8, num_kv_layers=2, kv_dim=8, dtype="bfloat16")
    pool = WorkerPool({})
    p, d1, d2 = _worker("p:1", "prefill", layout), _worker("d:1", "decode", layout), _worker("d:2", "decode", other)
    pool.workers = {w.address: w for w in (p, d1, d2)}
    assert [(a.address, b.address) for a, b in cold_pairs(pool)] == [("p:1", "d:1")]  # d:2 cannot pair with p:1
    sent = []

    async def relay(rid, ids, params, prefill, decode, deadline):
        sent.append((prefill.address, decode.address, list(ids), params.max_new_tokens))
        yield "a chunk"

    assert asyncio.run(warm_pairs(pool, relay, vocab_size=lambda: 100)) == 1
    assert sent == [("p:1", "d:1", [10, 10], 2)] and cold_pairs(pool) == []
    assert asyncio.run(warm_pairs(pool, relay, vocab_size=lambda: 100)) == 0  # nothing cold: nothing sent
    pool.mark_down(d1, "refused", "restarted")
    d1.healthy, d1.info = True, pb.WorkerInfo(address="d:1", layout=layout_to_proto(layout))  # back, a new process
    assert [(a.address, b.address) for a, b in cold_pairs(pool)] == [("p:1", "d:1")]

    async def failing(rid, ids, params, prefill, decode, deadline):
        raise RuntimeError("decode worker refused")
        yield

    assert asyncio.run(warm_pairs(pool, failing, vocab_size=lambda: 100)) == 0  # logged; the stack serves anyway
    assert cold_pairs(pool) == []  # attempted: not retried at every refresh
