"""A worker whose KV layout no worker of the other role shares (another page size, another model) joins a live
stack: the router never routes to it (it looked least busy, since the requests it got failed at once, and took most
of the traffic), says so once in its log and counts it; every request is served by the workers that can pair."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pdserve.sampling import SamplingParams

from stack import generate, start, start_all, stop_all
from test_serving_redis import counters


def test_a_decode_worker_with_another_page_size_is_never_chosen(tiny_v3_dir, tmp_path):
    common = ["--model", str(tiny_v3_dir), "--num-pages", "256", "--skip-warmup"]
    procs = start_all([("prefill", [*common, "--page-size", "4", "--worker-id", "p0"], "p0"),
                       ("decode", [*common, "--page-size", "4", "--worker-id", "d0"], "d0"),
                       ("decode", [*common, "--page-size", "8", "--worker-id", "d-odd"], "d-odd")], tmp_path)
    prefill, good, odd = procs
    try:
        router = start("router", ["--model", str(tiny_v3_dir), "--prefill", prefill.address, "--decode",
                                  good.address, "--decode", odd.address], tmp_path, "router")
        procs.append(router)
        params = SamplingParams(max_new_tokens=3, temperature=0.0)
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: generate(router.address, [5, 6, 7, i % 50 + 8], params, timeout=60),
                                    range(30)))
        assert all(r.completion_tokens == 3 for r in results)
        log = router.log()
        assert log.count(f"decode worker {odd.address} is not routed to") == 1, log[-3000:]
        assert "page_size: decode 8 vs prefill 4" in log
        assert counters(router, "pdserve_workers_down_total", "reason").get("incompatible") == 1
    finally:
        stop_all(procs)
