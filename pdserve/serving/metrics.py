"""Prometheus metrics, one registry per process, served on /metrics by every pdserve process.

Names are `pdserve_*` with units in the name; labels are few and bounded (role, outcome, reason). Objects are
created per process (not module globals mutated at start-up) and passed to whoever records.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)  # tokens per verification row (accepted drafts + 1)
STRETCH_BUCKETS = (1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)  # a replay's time over its graph's fastest
SPEC_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Metrics:
    registry: CollectorRegistry
    requests: Counter  # by outcome: finished, aborted, failed, rejected
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_length: Gauge
    running: Gauge
    kv_pool_usage: Gauge
    prefix_hit_tokens: Counter
    prompt_tokens: Counter
    prompts_received: Counter  # prefill: by rpc (PrefillStream: a router's open call, the one way in)
    generated_tokens: Counter
    transfer_bytes: Counter  # by transport (tcp, cuda_ipc, nccl, gloo): what the pair's rows travelled over
    transfer_seconds: Histogram  # by transport; record through Metrics.observe
    transfer_failures: Counter  # by kind and transport
    router_decisions: Counter  # by reason: prefix_hit, load
    redis_errors: Counter
    registrations_rejected: Counter  # router: Redis worker entries refused (by reason: signature, expired, unsigned)
    ownership_rejected: Counter  # router: Redis prefix-ownership entries refused (by reason)
    workers_down: Counter  # router: workers taken out of routing (by reason: refused, missed_checks, stalled)
    spec_accept_length: Histogram  # speculative decoding: tokens emitted per verification row that drafted
    spec_draft_seconds: Histogram  # per round: the MTP draft chain and the draft extend
    spec_verify_seconds: Histogram  # per round: the target's verification forward and acceptance
    step_hold_seconds: Counter  # decode: time its steps waited for pacing (decode_service/pacing.py)
    replay_stretch: Histogram  # decode, when pacing by GPU share: each graph replay's time / its fastest

    @classmethod
    def create(cls, role: str) -> "Metrics":
        r = CollectorRegistry()
        const = {"role": role}

        def counter(name, doc, labels=()):
            # Counters keep their extra labels open; record through Metrics.count, which adds the role.
            return Counter(name, doc, ["role", *labels], registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, ["role"], registry=r).labels(**const)

        def hist(name, doc, buckets):
            return Histogram(name, doc, ["role"], buckets=buckets, registry=r).labels(**const)

        m = cls(
            registry=r,
            requests=counter("pdserve_requests", "Requests by outcome (finished, aborted, failed, rejected)",
                             ["outcome"]),
            ttft=hist("pdserve_time_to_first_token_seconds", "Time from arrival to the first token", LATENCY_BUCKETS),
            itl=hist("pdserve_inter_token_latency_seconds", "Time between consecutive streamed tokens", ITL_BUCKETS),
            e2e=hist("pdserve_e2e_request_latency_seconds", "Time from arrival to the last token", LATENCY_BUCKETS),
            queue_length=gauge("pdserve_num_queue_reqs", "Requests waiting to be scheduled"),
            running=gauge("pdserve_num_running_reqs", "Requests being computed"),
            kv_pool_usage=gauge("pdserve_kv_pool_usage_ratio", "Fraction of KV pages held by requests"),
            prefix_hit_tokens=counter("pdserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
            prompt_tokens=counter("pdserve_prompt_tokens", "Prompt tokens received"),
            prompts_received=counter("pdserve_prompts_received", "Prefill worker: prompts received, by rpc "
                                     "(PrefillStream: on a router's open call)", ["rpc"]),
            generated_tokens=counter("pdserve_generation_tokens", "Tokens generated"),
            transfer_bytes=counter("pdserve_kv_transfer_bytes", "KV bytes sent or received, by transport",
                                   ["transport"]),
            transfer_seconds=Histogram("pdserve_kv_transfer_seconds", "KV transfer time per request, by transport",
                                       ["role", "transport"], buckets=TRANSFER_BUCKETS, registry=r),
            transfer_failures=counter("pdserve_kv_transfer_failures", "Requests whose KV transfer failed",
                                      ["kind", "transport"]),
            router_decisions=counter("pdserve_router_decisions", "Prefill worker choices by reason", ["reason"]),
            redis_errors=counter("pdserve_redis_errors", "Failed Redis calls (routing degrades to load only)"),
            registrations_rejected=counter("pdserve_worker_registrations_rejected",
                                           "Worker entries in Redis the router refused to use (forged or stale)",
                                           ["reason"]),
            ownership_rejected=counter("pdserve_prefix_ownership_rejected",
                                       "Prefix-ownership entries in Redis the router refused to use (malformed, or "
                                       "not signed with its --internal-token), by reason", ["reason"]),
            workers_down=counter("pdserve_workers_down", "Workers the router took out of routing", ["reason"]),
            spec_accept_length=hist("pdserve_spec_accept_length",
                                    "Speculative decoding: tokens per verification row (accepted drafts + 1)",
                                    ACCEPT_LENGTH_BUCKETS),
            spec_draft_seconds=hist("pdserve_spec_draft_seconds",
                                    "Speculative decoding: MTP draft steps and draft extend per round",
                                    SPEC_TIME_BUCKETS),
            spec_verify_seconds=hist("pdserve_spec_verify_seconds",
                                     "Speculative decoding: target verification forward and acceptance per round",
                                     SPEC_TIME_BUCKETS),
            step_hold_seconds=counter("pdserve_decode_step_hold_seconds",
                                      "Decode worker: time its steps were held back by pacing while prompts bound "
                                      "for it were prefilled (--gpu-share-while-prefilling, --min-step-interval-ms)"),
            replay_stretch=hist("pdserve_decode_replay_stretch",
                                "Decode worker pacing by GPU share: each CUDA graph replay's GPU time over its "
                                "graph's fastest (near 1: the GPU ran it alone; above: another process's kernels "
                                "ran in between)", STRETCH_BUCKETS),
        )
        m._role = role  # type: ignore[attr-defined]
        return m

    def count(self, counter: Counter, amount: float = 1.0, **labels: str) -> None:
        counter.labels(role=self._role, **labels).inc(amount)  # type: ignore[attr-defined]

    def observe(self, histogram: Histogram, value: float, **labels: str) -> None:
        """For the histograms with labels beyond the role (transfer_seconds)."""
        histogram.labels(role=self._role, **labels).observe(value)  # type: ignore[attr-defined]


class SpecMetrics:
    """The engine's speculative-decoding observer (pdserve.spec_decode.SpecObserver) recording into Metrics."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def on_spec_round(self, stats) -> None:
        for n in stats.accept_lengths:
            self.metrics.spec_accept_length.observe(n)
        self.metrics.spec_draft_seconds.observe(stats.draft_seconds)
        self.metrics.spec_verify_seconds.observe(stats.verify_seconds)


_server_lock = threading.Lock()


def serve_metrics(metrics: Metrics, port: int, host: str = "127.0.0.1") -> int:
    """Serve /metrics over HTTP on host (the process's own --host: a worker kept on loopback keeps its metrics
    there too); port 0 picks a free port. Returns the port."""
    with _server_lock:
        server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return server.server_port
