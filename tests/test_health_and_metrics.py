"""What a live stack tells its monitoring (issue 49, items 3 and 6), scraped and probed as Prometheus and Kubernetes
do: each process exports the metrics of its role only, each series labelled with the model's name; the counters an
alert or a dashboard panel reads exist at 0 before their first event; and a router's grpc.health.v1 answer is its
HTTP /health answer: NOT_SERVING (503) without a healthy worker pair, SERVING (200) with one."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.sampling import SamplingParams

from stack import free_port, generate, scrape, spawn, start_stack

pytestmark = pytest.mark.slow
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
KINDS = {"incompatible", "unauthenticated", "unreachable", "timeout", "aborted", "peer_failed", "protocol"}
# Families (names as the parser gives them) only one role exports.
ROUTER_ONLY = {"pdserve_router_decisions", "pdserve_workers_down", "pdserve_worker_registrations_rejected"}
PREFILL_ONLY = {"pdserve_prompts_received", "pdserve_kv_transfer_bytes", "pdserve_kv_transfer_seconds"}
DECODE_ONLY = {"pdserve_decode_step_hold_seconds", "pdserve_decode_replay_stretch", "pdserve_spec_accept_length",
               "pdserve_spec_draft_seconds", "pdserve_spec_verify_seconds"}
WORKER_ONLY = {"pdserve_kv_pool_usage_ratio", "pdserve_num_queue_reqs", "pdserve_num_running_reqs",
               "pdserve_kv_transfer_failures"}


@pytest.fixture(scope="module")
def stack(tiny_v3_dir, tmp_path_factory):
    http_port = free_port()
    s = start_stack(tiny_v3_dir, tmp_path_factory.mktemp("logs-health-metrics"),
                    router_args=["--http-port", str(http_port)])
    s.http_port = http_port
    yield s
    s.stop()


def series(proc) -> dict[str, list]:
    """family name -> its samples, from the process's /metrics."""
    return {f.name: f.samples for f in text_string_to_metric_families(scrape(proc))}


def by_label(families: dict, name: str, *labels: str) -> dict[tuple, float]:
    """The samples named `name`, keyed by the values of `labels`."""
    return {tuple(s.labels[k] for k in labels): s.value for f in families.values() for s in f if s.name == name}


def test_each_process_exports_its_roles_metrics_labelled_with_the_model(stack, tiny_v3_dir):
    generate(stack.router.address, "Hello there", SamplingParams(max_new_tokens=4, ignore_eos=True))
    exported = {"router": series(stack.router), "prefill": series(stack.prefill[0]),
                "decode": series(stack.decode[0])}
    others = {"router": PREFILL_ONLY | DECODE_ONLY | WORKER_ONLY, "prefill": ROUTER_ONLY | DECODE_ONLY,
              "decode": ROUTER_ONLY | PREFILL_ONLY}
    for role, families in exported.items():
        assert not set(families) & others[role], f"{role} exports {sorted(set(families) & others[role])}"
        samples = [s for f in families.values() for s in f]
        assert samples and all(s.labels.get("model_name") == tiny_v3_dir.name for s in samples), role
        assert {s.labels["role"] for s in samples} == {role}
    assert ROUTER_ONLY <= set(exported["router"])
    assert PREFILL_ONLY | WORKER_ONLY <= set(exported["prefill"])
    assert DECODE_ONLY | WORKER_ONLY <= set(exported["decode"])


def test_counters_start_at_zero_for_their_label_sets(stack):
    """Before their first event: the series a dashboard panel or an alert's increase() reads are there, at 0."""
    router, prefill, decode = series(stack.router), series(stack.prefill[0]), series(stack.decode[0])
    for families in (router, prefill, decode):
        outcomes = by_label(families, "pdserve_requests_total", "outcome")
        assert set(outcomes) == {("finished",), ("aborted",), ("failed",), ("rejected",)}, outcomes
        assert outcomes[("failed",)] == 0
    for families in (router, prefill):
        assert list(by_label(families, "pdserve_redis_errors_total").values()) == [0.0]
    assert list(by_label(decode, "pdserve_decode_step_hold_seconds_total").values()) == [0.0]
    for families in (prefill, decode):
        failures = by_label(families, "pdserve_kv_transfer_failures_total", "kind", "transport")
        assert {kind for kind, _ in failures} == KINDS and set(failures.values()) == {0.0}
        assert ("timeout", "tcp") in failures, sorted(failures)  # tcp: what this CPU stack's pairs report
    assert set(by_label(router, "pdserve_workers_down_total", "reason")) == \
        {("refused",), ("missed_checks",), ("stalled",), ("incompatible",)}


def health(stack, address: str = None, http_port: int = None) -> tuple[int, int, int]:
    """(gRPC status for the server, gRPC status for pdserve.v1.Generation, HTTP /health status)."""
    with grpc.insecure_channel(address or stack.router.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        whole = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        service = stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=5).status
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port or stack.http_port}/health", timeout=5) as r:
            http = r.status
    except urllib.error.HTTPError as e:
        http = e.code
        assert "no healthy workers" in json.loads(e.read())["error"]["message"]
    return whole, service, http


def test_a_router_without_workers_is_not_serving_on_grpc_as_on_http(stack, tiny_v3_dir, tmp_path):
    """What Kubernetes' readiness probe and the images' HEALTHCHECK ask (gRPC), answered as /health answers."""
    assert health(stack) == (SERVING, SERVING, 200)
    http_port = free_port()
    lonely = spawn("router", ["--model", str(tiny_v3_dir), "--prefill", f"127.0.0.1:{free_port()}", "--decode",
                              f"127.0.0.1:{free_port()}", "--http-port", str(http_port)], tmp_path, "lonely")
    try:
        deadline = time.monotonic() + 30
        while "router serving" not in lonely.log():  # its gRPC and HTTP ports are open
            assert lonely.popen.poll() is None and time.monotonic() < deadline, lonely.log()
            time.sleep(0.1)
        assert health(stack, lonely.address, http_port) == (NOT_SERVING, NOT_SERVING, 503)
    finally:
        lonely.stop()


def test_a_router_whose_workers_go_away_stops_serving_on_both(stack):
    """Last: it stops the decode worker. The Watch stream (what gRPC clients and probes follow) sees the change."""
    with grpc.insecure_channel(stack.router.address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == SERVING
        stack.decode[0].stop()
        assert next(watch).status == NOT_SERVING
        watch.cancel()
    deadline = time.monotonic() + 10
    while health(stack)[2] != 503:  # the HTTP answer follows the same pool: at once, or within one check
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert health(stack) == (NOT_SERVING, NOT_SERVING, 503)
