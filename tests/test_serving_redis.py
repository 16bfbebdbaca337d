"""Workers discovered through Redis, prefix ownership read from Redis, and a Redis outage in the middle of traffic:
requests keep succeeding (routing by load), and ownership routing resumes once Redis is back."""

from __future__ import annotations

import shutil
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams

from redis_server import RedisServer
from stack import generate, scrape, start_stack

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs Debian's redis-server")]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def counters(proc, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(scrape(proc)):
        for s in family.samples:
            if s.name == name:
                out[s.labels.get(label, "")] = out.get(s.labels.get(label, ""), 0.0) + s.value
    return out


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def owned_by_redis(redis: RedisServer, n_workers_min: int = 1) -> bool:
    try:
        return len(list(redis.client().scan_iter("pdserve:wblk:*"))) >= n_workers_min
    except Exception:
        return False


def test_redis_discovery_ownership_and_outage(tiny_v3_dir, tmp_path):
    engine = LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=512)))
    redis = RedisServer().start()
    stack = start_stack(tiny_v3_dir, tmp_path, n_prefill=2, n_decode=1, redis_url=redis.url)
    try:
        address = stack.router.address

        def served():  # the router found the workers through Redis alone (no addresses were given)
            try:
                return generate(address, "Hello", GREEDY, timeout=10)
            except Exception:
                return None

        wait_until(served, 20, "the router to discover workers in Redis")
        base = "Multi-head latent attention stores one small latent vector per token per layer. " * 2
        generate(address, base + "first", GREEDY)
        wait_until(lambda: owned_by_redis(redis), 5, "the prefill worker to publish its blocks")
        hits = counters(stack.router, "pdserve_router_decisions_total", "reason").get("prefix_hit", 0)
        second = generate(address, base + "second", GREEDY)
        assert second.cached_tokens > 0
        assert counters(stack.router, "pdserve_router_decisions_total", "reason")["prefix_hit"] == hits + 1

        redis.stop()  # outage: every request must still succeed, routed by load
        for i in range(4):
            prompt = base + f"during the outage {i}"
            got = generate(address, prompt, GREEDY, timeout=30)
            assert got.output_ids == engine.generate([prompt], GREEDY)[0].output_ids
        assert counters(stack.router, "pdserve_redis_errors_total", "role").get("router", 0) > 0

        redis.start()  # same port, empty (no persistence): workers re-register and republish
        base2 = "The quick brown fox jumps over the lazy dog. Hello, world! " * 2
        wait_until(lambda: served(), 20, "requests after Redis restarted")
        generate(address, base2 + "one", GREEDY)
        wait_until(lambda: owned_by_redis(redis), 10, "ownership republished after the restart")
        time.sleep(1.1)  # the router retries Redis one second after its last failure

        def resumed():
            before = counters(stack.router, "pdserve_router_decisions_total", "reason").get("prefix_hit", 0)
            generate(address, base2 + "two", GREEDY)
            return counters(stack.router, "pdserve_router_decisions_total", "reason")["prefix_hit"] > before

        wait_until(resumed, 10, "prefix-ownership routing to resume")
    finally:
        stack.stop()
        redis.stop()
