"""Overload and deadlines on a real stack: bounded queues answer RESOURCE_EXHAUSTED at once instead of letting
requests wait without bound; a client deadline ends the request with DEADLINE_EXCEEDED and frees its pages on both
tiers."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from stack import start_stack, wait_idle
from test_faults import one

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_v3_dir, tmp_path_factory):
    s = start_stack(tiny_v3_dir, tmp_path_factory.mktemp("logs-overload"),
                    engine_args=["--max-num-batched-tokens", "16", "--max-queued-requests", "2"],
                    router_args=["--max-concurrent-requests", "4"])
    yield s
    s.stop()


def assert_idle(stack) -> None:
    for proc in stack.prefill + stack.decode:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages and idle.num_running_requests == 0, proc.role


def test_full_queues_answer_resource_exhausted_quickly(stack):
    prompts = [[10 + (i * 3 + j) % 400 for j in range(200)] for i in range(10)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: one(stack.router.address, p, 16), prompts))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {"OK", "RESOURCE_EXHAUSTED"}, statuses
    assert 1 <= statuses.count("OK") <= 4  # the router admits 4; the workers' queues may refuse some of those
    rejected = [t for s, _, t in results if s == "RESOURCE_EXHAUSTED"]
    assert len(rejected) >= 6 and max(rejected) < 2.0, f"rejections took {rejected}"
    assert_idle(stack)
    assert one(stack.router.address, [5, 6, 7], 4)[0] == "OK"


def test_worker_queue_bound_refuses_the_excess(stack):
    # 4 admitted by the router, all reserved on decode at once: its queue of rooms waiting for KV holds 2.
    prompts = [[10 + (i * 5 + j) % 400 for j in range(200)] for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: one(stack.router.address, p, 8), prompts))
    assert "RESOURCE_EXHAUSTED" in [s for s, _, _ in results] and "OK" in [s for s, _, _ in results]
    assert_idle(stack)


def test_client_deadline_is_deadline_exceeded_and_frees_pages(stack):
    t0 = time.monotonic()
    status, streamed, elapsed = one(stack.router.address, [5, 6, 7, 8], 1500, timeout=1.0)
    assert status == "DEADLINE_EXCEEDED" and streamed > 0  # it was decoding when time ran out
    assert elapsed < 1.5, f"the deadline was honoured only after {elapsed:.2f}s"
    assert_idle(stack)
    # A deadline that passes while the prompt is still being prefilled.
    status, streamed, _ = one(stack.router.address, [9] * 1000, 4, timeout=0.05)
    assert status == "DEADLINE_EXCEEDED" and streamed == 0
    assert_idle(stack)
    assert time.monotonic() - t0 < 15
