"""Prometheus metrics, one registry per process, served on /metrics by every pdserve process.

Names are `pdserve_*` with units in the name; labels are few and bounded (role, outcome, reason, kind, transport),
and every series also carries `model_name` (the served model's, as vLLM and SGLang label theirs). Each process exports
the metrics of its role only (ROLE_METRICS): a router has no KV pool, a prefill worker no routing decisions. Counters
whose label values are known up front start at 0 rather than appearing at their first event, so a dashboard shows 0
instead of "No data" and an alert's increase() sees the first event. Objects are created per process (not module
globals mutated at start-up) and passed to whoever records.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)  # tokens per verification row (accepted drafts + 1)
STRETCH_BUCKETS = (1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)  # a replay's time over its graph's fastest
SPEC_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# The metrics each kind of process exports (the names of Metrics' fields); on the Metrics of another role they are
# None. A router routes and streams (its own view of each request), a prefill worker computes prompts and sends their
# KV, a decode worker receives KV and generates.
_POOL = {"queue_length", "running", "kv_pool_usage"}
ROLE_METRICS = {
    "router": {"requests", "ttft", "itl", "e2e", "prefix_hit_tokens", "prompt_tokens", "generated_tokens",
               "router_decisions", "redis_errors", "registrations_rejected", "ownership_rejected", "workers_down"},
    "prefill": _POOL | {"requests", "ttft", "prefix_hit_tokens", "prompt_tokens", "prompts_received",
                        "transfer_bytes", "transfer_seconds", "transfer_failures", "transfer_links", "redis_errors"},
    "decode": _POOL | {"requests", "itl", "e2e", "generated_tokens", "transfer_failures", "spec_accept_length",
                       "spec_draft_seconds", "spec_verify_seconds", "step_hold_seconds", "replay_stretch"},
}
# Label values known when a process starts, whose series start at 0 (see the module's docstring). A worker adds its
# transfer series (Metrics.start_transfers_at_zero): the transports and failure kinds are the KV transfer's.
START_AT_ZERO = {
    "requests": {"outcome": ("finished", "aborted", "failed", "rejected")},
    "router_decisions": {"reason": ("prefix_hit", "load", "retry")},
    "workers_down": {"reason": ("refused", "missed_checks", "stalled", "incompatible")},
    "registrations_rejected": {"reason": ("malformed", "unsigned", "signature", "expired")},
    "ownership_rejected": {"reason": ("malformed", "unsigned", "signature")},
    "prompts_received": {"rpc": ("PrefillStream",)},
    "redis_errors": {}, "prefix_hit_tokens": {}, "prompt_tokens": {}, "generated_tokens": {},
    "step_hold_seconds": {},
}


@dataclass
class Metrics:
    """One process's metrics: those of its role (ROLE_METRICS), the others None."""

    registry: CollectorRegistry  # what /metrics serves: the role's metrics, each series labelled with model_name
    requests: Counter  # by outcome: finished, aborted, failed, rejected
    ttft: Optional[Histogram]
    itl: Optional[Histogram]
    e2e: Optional[Histogram]
    queue_length: Optional[Gauge]
    running: Optional[Gauge]
    kv_pool_usage: Optional[Gauge]
    prefix_hit_tokens: Optional[Counter]
    prompt_tokens: Optional[Counter]
    prompts_received: Optional[Counter]  # prefill: by rpc (PrefillStream: a router's open call, the one way in)
    generated_tokens: Optional[Counter]
    transfer_bytes: Optional[Counter]  # by transport (tcp, cuda_ipc, nccl, gloo): what the pair's rows travelled over
    transfer_seconds: Optional[Histogram]  # by transport; record through Metrics.observe
    transfer_failures: Optional[Counter]  # by kind and transport
    transfer_links: Optional[Gauge]  # prefill: 1 by transport and link, what its library picked (nixl: UCX's)
    router_decisions: Optional[Counter]  # by reason: prefix_hit, load, retry
    redis_errors: Optional[Counter]
    registrations_rejected: Optional[Counter]  # router: Redis worker entries refused (by reason)
    ownership_rejected: Optional[Counter]  # router: Redis prefix-ownership entries refused (by reason)
    workers_down: Optional[Counter]  # router: workers taken out of routing (by reason: refused, missed_checks, ...)
    spec_accept_length: Optional[Histogram]  # speculative decoding: tokens emitted per verification row that drafted
    spec_draft_seconds: Optional[Histogram]  # per round: the MTP draft chain and the draft extend
    spec_verify_seconds: Optional[Histogram]  # per round: the target's verification forward and acceptance
    step_hold_seconds: Optional[Counter]  # decode: time its steps waited for pacing (decode_service/pacing.py)
    replay_stretch: Optional[Histogram]  # decode, when pacing by GPU share: each graph replay's time / its fastest

    @classmethod
    def create(cls, role: str) -> "Metrics":
        """The metrics of `role` (router, prefill or decode); their model_name label is left out until name_model."""
        if role not in ROLE_METRICS:
            raise ValueError(f"Metrics.create: role must be one of {sorted(ROLE_METRICS)}, got {role!r}")
        r = CollectorRegistry()
        const = {"role": role}
        mine = ROLE_METRICS[role]

        def counter(field, name, doc, labels=()):
            # Counters keep their extra labels open; record through Metrics.count, which adds the role.
            return Counter(name, doc, ["role", *labels], registry=r) if field in mine else None

        def gauge(field, name, doc, labels=()):
            if field not in mine:
                return None
            g = Gauge(name, doc, ["role", *labels], registry=r)
            return g.labels(**const) if not labels else g  # with more labels: set through Metrics.note_link

        def hist(field, name, doc, buckets, labels=()):
            if field not in mine:
                return None
            h = Histogram(name, doc, ["role", *labels], buckets=buckets, registry=r)
            return h.labels(**const) if not labels else h  # with more labels: record through Metrics.observe

        served = CollectorRegistry(auto_describe=False)
        m = cls(
            registry=served,
            requests=counter("requests", "pdserve_requests",
                             "Requests by outcome (finished, aborted, failed, rejected)", ["outcome"]),
            ttft=hist("ttft", "pdserve_time_to_first_token_seconds", "Time from arrival to the first token",
                      LATENCY_BUCKETS),
            itl=hist("itl", "pdserve_inter_token_latency_seconds", "Time between consecutive streamed tokens",
                     ITL_BUCKETS),
            e2e=hist("e2e", "pdserve_e2e_request_latency_seconds", "Time from arrival to the last token",
                     LATENCY_BUCKETS),
            queue_length=gauge("queue_length", "pdserve_num_queue_reqs", "Requests waiting to be scheduled"),
            running=gauge("running", "pdserve_num_running_reqs", "Requests being computed"),
            kv_pool_usage=gauge("kv_pool_usage", "pdserve_kv_pool_usage_ratio",
                                "Fraction of KV pages held by requests"),
            prefix_hit_tokens=counter("prefix_hit_tokens", "pdserve_prefix_cache_hit_tokens",
                                      "Prompt tokens served from the prefix cache"),
            prompt_tokens=counter("prompt_tokens", "pdserve_prompt_tokens", "Prompt tokens received"),
            prompts_received=counter("prompts_received", "pdserve_prompts_received",
                                     "Prefill worker: prompts received, by rpc (PrefillStream: on a router's open "
                                     "call)", ["rpc"]),
            generated_tokens=counter("generated_tokens", "pdserve_generation_tokens", "Tokens generated"),
            transfer_bytes=counter("transfer_bytes", "pdserve_kv_transfer_bytes",
                                   "KV bytes sent or received, by transport", ["transport"]),
            transfer_seconds=hist("transfer_seconds", "pdserve_kv_transfer_seconds",
                                  "KV transfer time per request, by transport", TRANSFER_BUCKETS, ["transport"]),
            transfer_failures=counter("transfer_failures", "pdserve_kv_transfer_failures",
                                      "Requests whose KV transfer failed", ["kind", "transport"]),
            transfer_links=gauge("transfer_links", "pdserve_kv_transfer_links",
                                 "1 for each link a transport's library picked for this worker's KV transfers "
                                 "(nixl: the UCX transports, e.g. rc_mlx5/mlx5_0:1 for RDMA, cuda_ipc/cuda for "
                                 "NVLink, tcp/eth0)", ["transport", "link"]),
            router_decisions=counter("router_decisions", "pdserve_router_decisions",
                                     "Prefill worker choices by reason", ["reason"]),
            redis_errors=counter("redis_errors", "pdserve_redis_errors",
                                 "Failed Redis calls (routing degrades to load only)"),
            registrations_rejected=counter("registrations_rejected", "pdserve_worker_registrations_rejected",
                                           "Worker entries in Redis the router refused to use (forged or stale)",
                                           ["reason"]),
            ownership_rejected=counter("ownership_rejected", "pdserve_prefix_ownership_rejected",
                                       "Prefix-ownership entries in Redis the router refused to use (malformed, or "
                                       "not signed with its --internal-token), by reason", ["reason"]),
            workers_down=counter("workers_down", "pdserve_workers_down", "Workers the router took out of routing",
                                 ["reason"]),
            spec_accept_length=hist("spec_accept_length", "pdserve_spec_accept_length",
                                    "Speculative decoding: tokens per verification row (accepted drafts + 1)",
                                    ACCEPT_LENGTH_BUCKETS),
            spec_draft_seconds=hist("spec_draft_seconds", "pdserve_spec_draft_seconds",
                                    "Speculative decoding: MTP draft steps and draft extend per round",
                                    SPEC_TIME_BUCKETS),
            spec_verify_seconds=hist("spec_verify_seconds", "pdserve_spec_verify_seconds",
                                     "Speculative decoding: target verification forward and acceptance per round",
                                     SPEC_TIME_BUCKETS),
            step_hold_seconds=counter("step_hold_seconds", "pdserve_decode_step_hold_seconds",
                                      "Decode worker: time its steps were held back by pacing while prompts bound "
                                      "for it were prefilled (--gpu-share-while-prefilling, --min-step-interval-ms)"),
            replay_stretch=hist("replay_stretch", "pdserve_decode_replay_stretch",
                                "Decode worker pacing by GPU share: each CUDA graph replay's GPU time over its "
                                "graph's fastest (near 1: the GPU ran it alone; above: another process's kernels "
                                "ran in between)", STRETCH_BUCKETS),
        )
        m._role = role  # type: ignore[attr-defined]
        m._model_name = lambda: ""  # type: ignore[attr-defined]
        served.register(_WithModelName(r, lambda: m._model_name()))  # type: ignore[attr-defined]
        for field, labels in START_AT_ZERO.items():
            if field in mine:
                m.start_at_zero(getattr(m, field), **labels)
        return m

    def name_model(self, name: Union[str, Callable[[], str]]) -> None:
        """The served model's name for the model_name label of every series, or where it is read when /metrics is
        scraped (a router knows it once a worker has reported)."""
        self._model_name = name if callable(name) else (lambda: name)  # type: ignore[attr-defined]

    def start_at_zero(self, metric, **label_values: Iterable[str]) -> None:
        """The series of every combination of these label values (and this role), at 0 until they are recorded."""
        names = list(label_values)
        for values in itertools.product(*(label_values[n] for n in names)):
            metric.labels(role=self._role, **dict(zip(names, values)))  # type: ignore[attr-defined]

    def start_transfers_at_zero(self, kinds: Iterable[str], transports: Iterable[str]) -> None:
        """A worker's transfer series at 0: failures by kind and transport; a prefill worker's bytes and times by
        transport (the transports its pairs may report)."""
        transports = sorted(set(transports))
        self.start_at_zero(self.transfer_failures, kind=sorted(kinds), transport=transports)
        for metric in (self.transfer_bytes, self.transfer_seconds):
            if metric is not None:
                self.start_at_zero(metric, transport=transports)

    def count(self, counter: Counter, amount: float = 1.0, **labels: str) -> None:
        counter.labels(role=self._role, **labels).inc(amount)  # type: ignore[attr-defined]

    def note_link(self, transport: str, link: str) -> None:
        """A KV transfer of this worker's went over `link` (`SendHandle.link`)."""
        self.transfer_links.labels(role=self._role, transport=transport, link=link).set(1)  # type: ignore

    def observe(self, histogram: Histogram, value: float, **labels: str) -> None:
        """For the histograms with labels beyond the role (transfer_seconds)."""
        histogram.labels(role=self._role, **labels).observe(value)  # type: ignore[attr-defined]


class _WithModelName:
    """The role's registry as /metrics serves it: every sample with the model_name label added (read at each
    scrape), left out while the name is not known."""

    def __init__(self, inner: CollectorRegistry, model_name: Callable[[], str]):
        self.inner, self.model_name = inner, model_name

    def describe(self) -> list:
        return []  # nothing to check against other collectors: this is the registry's only one

    def collect(self):
        name = self.model_name()
        for family in self.inner.collect():
            if name:
                family.samples = [s._replace(labels={**s.labels, "model_name": name}) for s in family.samples]
            yield family


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
