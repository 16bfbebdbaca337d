"""`pdserve prefill | decode | router | healthcheck` and the gRPC client side of `pdserve generate --target`
(`pdserve up`, which runs them all locally, is in up.py)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import socket
import sys
import time
from typing import Optional

from pdserve.cli.choices import LazyChoices
from pdserve.common.progress import say as _say

log = logging.getLogger("pdserve")





def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group(f"{role} worker")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=0, help="gRPC port (0 = a free one, printed at start)")
    g.add_argument("--advertise-host", default=None, help="host peers should dial (default: --host)")
    g.add_argument("--ready-fd", type=int, default=None, metavar="FD",
                   help="once serving, write the gRPC port as one line to this inherited file descriptor and close "
                        "it: how a supervisor that starts workers with --port 0 learns their ports (pdserve up "
                        "does)")
    g.add_argument("--worker-id", default=None, help="stable id (default: role-hostname-pid-random)")
    g.add_argument("--kv-transport", default="auto", choices=LazyChoices(kv_transport_names),
                   help=KV_TRANSPORT_HELP)
    g.add_argument("--nixl-backend", default=None, metavar="NAME", help=NIXL_BACKEND_HELP)
    g.add_argument("--transfer-timeout", type=float, default=300.0, metavar="S",
                   help="seconds a KV transfer may take before the request fails (default 300)")
    g.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    g.add_argument("--redis-url", default=None,
                   help="register in Redis for discovery (and, prefill, publish prefix-cache ownership)")
    if role == "prefill":
        g.add_argument("--no-kv-layerwise", action="store_true",
                       help="send a prompt's KV only after its whole forward instead of layer by layer as each "
                            "layer finishes (to measure what layer-wise streaming saves in TTFT)")
    if role == "decode":
        g.add_argument("--kv-host", default=None, help="KV receiver address (default: --host)")
        g.add_argument("--kv-port", type=int, default=0, help="KV receiver port (0 = a free one)")
        add_min_step_interval_arg(g, "--min-step-interval-ms")
        add_gpu_share_arg(g)
    g.add_argument("--max-queued-requests", type=int, default=256, metavar="N",
                   help="requests waiting here (prefill: for compute; decode: for their KV) before new ones get "
                        "RESOURCE_EXHAUSTED (default 256)")
    add_warmup_args(g)
    add_reliability_args(p, internal_server=True)


def _milliseconds(text: str) -> float:
    try:
        ms = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not (ms >= 0 and math.isfinite(ms)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {text})")
    return ms


def add_min_step_interval_arg(g, flag: str) -> None:
    g.add_argument(flag, type=_milliseconds, default=0.0, metavar="MS", dest="min_step_interval_ms",
                   help="pace the decode worker: while prompts bound for it are still being prefilled, start a decode "
                        "step at most every MS milliseconds (default 0: back to back). On a GPU shared with the "
                        "prefill worker this trades inter-token latency for throughput: fewer, fuller decode steps "
                        "leave the prompts more of the GPU")


def _share(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (got {text})")
    return share


GPU_SHARE_HELP = ("for a decode worker on a GPU shared with a prefill worker: while prompts bound for it are still "
                  "being prefilled, keep its steps' own GPU time (their CUDA graphs', timed with CUDA events) to at "
                  "most this share of the time: after a step of G ms the next starts no sooner than G / SHARE ms "
                  "after it. Fewer, fuller decode steps leave the prompts more of the GPU (more output tok/s, a "
                  "shorter TTFT, a longer inter-token latency while prompts arrive). A worker on the CPU has no CUDA "
                  "graphs and is not limited")


def add_gpu_share_arg(g) -> None:
    g.add_argument("--gpu-share-while-prefilling", type=_share, default=1.0, metavar="SHARE",
                   dest="gpu_share_while_prefilling", help=GPU_SHARE_HELP + " (default 1: no limit)")


def up_gpu_share(text: str) -> "float | str":
    return text if text == "auto" else _share(text)


def add_warmup_args(g) -> None:
    g.add_argument("--skip-warmup", action="store_true",
                   help="report SERVING without first running each prompt size and decode batch once (on a GPU the "
                        "first requests then wait for kernel compiles; for tests that do not need it)")


KV_TRANSPORT_HELP = (
    "how KV moves from prefill to decode: auto (default): cuda_ipc when the two workers are on one host and the "
    "prefill GPU can write to the decode pool's GPU (the same GPU, or peer access), else tcp; the choice is "
    "logged when a pair first connects and is the `transport` label of pdserve_kv_transfer_*. tcp: through the "
    "host, any device. cuda_ipc: the prefill "
    "worker writes into the decode pool over CUDA IPC (same host, refused otherwise); "
    "nccl: GPU to GPU over NCCL, two different GPUs (never picked by auto); gloo: CPU pools; nixl: the "
    "prefill worker writes into the decode pool over NIXL (UCX: RDMA between hosts, NVLink, TCP; UCX_TLS and "
    "UCX_NET_DEVICES in the workers' environment restrict it; pip install 'pdserve[nixl]'), never picked by auto. "
    "Both tiers take the same value, or auto on either side of tcp or cuda_ipc")


NIXL_BACKEND_HELP = (
    "with --kv-transport nixl: the NIXL backend plugin its agents use (default UCX; the prefill and decode workers "
    "name the same). UCX picks its own transports from UCX_TLS and UCX_NET_DEVICES in the workers' environment")


# The KV transports (kv_transfer's registry, which imports torch), written out for the parser as the kernel backends
# are (engine_args.BACKEND_NAMES); tests/test_cli_surface.py keeps them equal.
KV_TRANSPORT_NAMES = ("auto", "cuda_ipc", "gloo", "nccl", "nixl", "tcp")


def kv_transport_names() -> list[str]:
    return list(KV_TRANSPORT_NAMES)


def add_reliability_args(p: argparse.ArgumentParser, internal_server: bool):
    """Drain and security flags shared by the workers and the router; returns their group."""
    g = p.add_argument_group("shutdown and security")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM: report NOT_SERVING, refuse new requests, give those in flight this long to "
                        "finish, then exit (default 30)")
    g.add_argument("--internal-token", default=None, metavar="TOKEN",
                   help="shared secret of the internal endpoints: " + (
                       "required from the router and prefill workers (gRPC and KV transfer)" if internal_server
                       else "sent to the workers"))
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="serve gRPC over TLS with this certificate")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA certificate to trust when dialling TLS servers (the router dialling workers)")
    return g


def security_from_args(args: argparse.Namespace):
    from pdserve.serving.auth import SecurityConfig

    return SecurityConfig(internal_token=getattr(args, "internal_token", None),
                          api_keys=tuple(getattr(args, "api_key", None) or ()),
                          tls_cert=getattr(args, "tls_cert", None), tls_key=getattr(args, "tls_key", None),
                          tls_ca=getattr(args, "tls_ca", None))


def _identity(args, role: str, port: int):
    from pdserve.serving.worker_common import WorkerIdentity, new_worker_id

    host = args.advertise_host or (args.host if args.host != "0.0.0.0" else socket.gethostname())
    return WorkerIdentity(args.worker_id or new_worker_id(role), role, f"{host}:{port}")


def _serve_metrics(metrics, port: Optional[int], host: str) -> Optional[int]:
    """On the process's own --host: a worker kept on loopback keeps its metrics there too."""
    if port is None:
        return None
    from pdserve.serving.metrics import serve_metrics

    try:
        return serve_metrics(metrics, port, host)
    except OSError as e:
        raise OSError(f"--metrics-port: cannot listen on {host}:{port}: {e.strerror or e}; pick another port with "
                      "--metrics-port") from None


def _register(args, worker, role: str, metrics_port: Optional[int]):
    if not args.redis_url:
        return None
    from pdserve.cluster.worker_registry import WorkerRegistration

    # Signed with the internal token, so that routers can tell this entry from a forged one.
    reg = WorkerRegistration(args.redis_url, secret=args.internal_token)
    reg.start({"worker_id": worker.identity.worker_id, "role": role, "address": worker.identity.address,
               "metrics_port": metrics_port})
    return reg


def _nccl_error_handling(args: argparse.Namespace) -> None:
    """NOTE: the nccl KV transport notices a failed pair itself and aborts that pair's communicator alone; torch's
    default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) takes the whole worker down on any NCCL error or op timeout of any
    pair. Read when a ProcessGroupNCCL is built, so it is set before any is; an operator's own value wins."""
    if args.kv_transport == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")


def _show_kv_pairings() -> None:
    """NOTE: which transport each prefill/decode pair uses (and why auto fell back) is logged at INFO by
    pdserve.kv_transfer; a worker shows those lines on stderr (it configures no other logging)."""
    kv_log = logging.getLogger("pdserve.kv_transfer")
    if kv_log.level == logging.NOTSET and not kv_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[pdserve] %(message)s"))
        kv_log.addHandler(handler)
        kv_log.setLevel(logging.INFO)


def _check_ready_fd(fd: Optional[int]) -> None:
    """Before the model loads: a --ready-fd that is not open would otherwise fail only after it. Not passed on to
    this worker's own children (its tensor-parallel ranks, compilers): one of them holding it open would hide this
    worker's exit from the supervisor reading the pipe."""
    from pdserve.cli.engine_args import UsageError

    if fd is None:
        return
    try:
        os.set_inheritable(fd, False)
    except OSError as e:
        raise UsageError(f"--ready-fd {fd}: not an open file descriptor ({e.strerror})") from None


def _announce_ready(fd: Optional[int], port: int) -> None:
    """--ready-fd: the port, once the server is up. A supervisor that has gone away (a closed pipe) is not this
    worker's failure: it is told to stop the usual way."""
    if fd is None:
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{port}\n")
    except OSError as e:
        log.warning("--ready-fd %d: could not announce port %d: %s", fd, port, e)


def _startup_times(start: float, built: float, warmup) -> str:
    """' (ready in 9.1 s: engine 3.2 s, warm-up 5.9 s)': where a worker's start-up went."""
    parts = [f"engine {built:.1f} s"] + ([f"warm-up {warmup.seconds:.1f} s"] if warmup else ["no warm-up"])
    return f" (ready in {time.monotonic() - start:.1f} s: {', '.join(parts)})"


def cmd_prefill(args: argparse.Namespace) -> int:
    from pdserve.cli.engine_args import engine_config_from_args
    from pdserve.serving.metrics import Metrics
    from pdserve.prefill_service.publisher import OwnershipPublisher
    from pdserve.prefill_service.server import PrefillWorker, PrefillWorkerConfig, serve_prefill

    _check_ready_fd(args.ready_fd)
    _nccl_error_handling(args)
    _show_kv_pairings()
    start = time.monotonic()
    metrics = Metrics.create("prefill")
    mport = _serve_metrics(metrics, args.metrics_port, args.host)  # first: a taken port fails before the model loads
    config = PrefillWorkerConfig(engine_config_from_args(args, prefill_only=True), host=args.host, port=args.port,
                                 kv_transport=args.kv_transport, nixl_backend=args.nixl_backend,
                                 kv_layerwise=not args.no_kv_layerwise,
                                 transfer_timeout_s=args.transfer_timeout,
                                 max_queued_requests=args.max_queued_requests, drain_timeout_s=args.drain_timeout,
                                 security=security_from_args(args), warmup=not args.skip_warmup)
    worker = PrefillWorker(config, _identity(args, "prefill", args.port), metrics)
    built = time.monotonic() - start
    state = {}

    def ready(port: int) -> None:
        worker.identity = dataclasses.replace(worker.identity, address=_identity(args, "prefill", port).address)
        if args.redis_url:
            from pdserve.cluster.ownership import RedisOwnership

            # Signed with the internal token, as the registration is: a router with the token uses only signed claims.
            store = RedisOwnership(args.redis_url, secret=getattr(args, "internal_token", None))
            try:  # a restarted worker with a stable id holds nothing yet
                store.drop_worker(worker.identity.worker_id)
            except Exception as e:
                log.warning("could not clear old prefix ownership in Redis: %s", e)
            state["publisher"] = OwnershipPublisher(store, worker.identity.worker_id, metrics).start()
            worker.publishers.append(state["publisher"])
        state["registration"] = _register(args, worker, "prefill", mport)
        _say(f"prefill worker {worker.identity.worker_id} serving on {worker.identity.address}"
             + (f", metrics on :{mport}" if mport else "") + _startup_times(start, built, worker.warmup_report))
        _announce_ready(args.ready_fd, port)

    asyncio.run(serve_prefill(worker, ready=ready))
    for key in ("registration", "publisher"):
        if state.get(key):
            state[key].stop()
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from pdserve.cli.engine_args import engine_config_from_args
    from pdserve.decode_service.server import DecodeWorker, DecodeWorkerConfig, serve_decode
    from pdserve.serving.metrics import Metrics

    _check_ready_fd(args.ready_fd)
    _nccl_error_handling(args)
    _show_kv_pairings()
    start = time.monotonic()
    metrics = Metrics.create("decode")
    mport = _serve_metrics(metrics, args.metrics_port, args.host)  # first: a taken port fails before the model loads
    engine = engine_config_from_args(args)
    # Decode keeps no prefix cache: its pages come from prefill and return to the pool when a request ends.
    engine = dataclasses.replace(engine, scheduler=dataclasses.replace(engine.scheduler, enable_prefix_cache=False))
    config = DecodeWorkerConfig(engine, host=args.host, port=args.port, kv_host=args.kv_host or args.host,
                                kv_port=args.kv_port, kv_transport=args.kv_transport, nixl_backend=args.nixl_backend,
                                transfer_timeout_s=args.transfer_timeout,
                                max_queued_requests=args.max_queued_requests, drain_timeout_s=args.drain_timeout,
                                security=security_from_args(args), warmup=not args.skip_warmup,
                                min_step_interval_s=args.min_step_interval_ms / 1e3,
                                gpu_share_while_prefilling=args.gpu_share_while_prefilling)
    worker = DecodeWorker(config, _identity(args, "decode", args.port), metrics)
    built = time.monotonic() - start
    state = {}

    def ready(port: int) -> None:
        worker.identity = dataclasses.replace(worker.identity, address=_identity(args, "decode", port).address)
        state["registration"] = _register(args, worker, "decode", mport)
        _say(f"decode worker {worker.identity.worker_id} serving on {worker.identity.address}, KV receiver on "
             f"{worker.kv_endpoint}" + (f", metrics on :{mport}" if mport else "")
             + _startup_times(start, built, worker.warmup_report))
        _announce_ready(args.ready_fd, port)

    asyncio.run(serve_decode(worker, ready=ready))
    if state.get("registration"):
        state["registration"].stop()
    return 0


def add_router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1",
                   help="address the gRPC, HTTP and metrics ports listen on (0.0.0.0 for all; default 127.0.0.1)")
    g.add_argument("--port", type=int, default=50051, help="client gRPC port (default 50051)")
    g.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", help="a prefill worker (repeat)")
    g.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="a decode worker (repeat)")
    g.add_argument("--redis-url", default=None,
                   help="discover workers and read prefix ownership from Redis (else in-process ownership)")
    g.add_argument("--model", default=None, metavar="DIR", help="model directory for the tokenizer (text prompts)")
    g.add_argument("--balance-threshold", type=int, default=4,
                   help="extra requests tolerated on the prefix owner before load decides (default 4)")
    g.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    g.add_argument("--skip-warmup", action="store_true",
                   help="serve without first sending one short request of the router's own through each "
                        "prefill/decode pair (each pair's first request then pays for its KV connection)")
    g.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) on this port, same host and process (0 = a free one; default: off)")
    hg = p.add_argument_group("worker health (see README, Reliability and security)")
    hg.add_argument("--health-check-interval", type=float, default=1.0, metavar="S",
                    help="seconds between load/health checks of each worker (default 1)")
    hg.add_argument("--health-check-timeout", type=float, default=1.0, metavar="S",
                    help="a check slower than this is a miss (default 1)")
    hg.add_argument("--health-check-misses", type=int, default=2, metavar="N",
                    help="consecutive missed checks before a worker is out of routing and its requests end with "
                         "UNAVAILABLE (default 2; a refused check takes it out at once)")
    hg.add_argument("--progress-timeout", type=float, default=5.0, metavar="S",
                    help="a decode worker that streams nothing for this long to requests that are decoding on it "
                         "is out of routing (default 5)")
    hg.add_argument("--wait-for-worker", type=float, default=5.0, metavar="S",
                    help="a request that finds no healthy worker waits this long (within its deadline) for one "
                         "before UNAVAILABLE (default 5)")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-new-tokens-limit", type=int, default=None, metavar="N",
                     help="refuse requests asking for more new tokens (default: only the model's context bounds it)")
    lim.add_argument("--max-concurrent-requests", type=int, default=1024, metavar="N",
                     help="requests in flight before new ones get RESOURCE_EXHAUSTED (default 1024)")
    lim.add_argument("--max-request-bytes", type=int, default=16 << 20, metavar="B",
                     help="largest request message accepted (default 16 MiB)")
    lim.add_argument("--tokenize-threads", type=int, default=2, metavar="N",
                     help="long text prompts tokenized at once, off the event loop (default 2)")
    add_stream_interval_arg(lim)
    add_reliability_args(p, internal_server=False).add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help="require 'authorization: Bearer KEY' from clients (repeatable: any of the keys)")


def add_stream_interval_arg(group) -> None:
    group.add_argument("--stream-interval", type=int, default=1, metavar="N",
                       help="after a request's first token (sent at once), stream its tokens N at a time (the last "
                            "message may hold fewer): fewer, larger messages for the router and clients at high "
                            "concurrency (default 1: every engine step's tokens as they come)")


async def run_router(args: argparse.Namespace, on_ready=None) -> None:
    from pdserve.serving.grpc_shell import stop_on_signals

    stop = stop_on_signals()  # first: a Ctrl-C while starting drains like one later
    from pdserve.serving.grpc_shell import serve_until_signal
    from pdserve.serving.metrics import Metrics
    from pdserve.cluster.ownership import OWNERSHIP_STORES
    from pdserve.router.server import Router, RouterConfig, start_router
    from pdserve.router.workers import HealthConfig, WorkerPool
    from pdserve.common.tokenizer import Tokenizer

    metrics = Metrics.create("router")
    if args.redis_url:
        from pdserve.cluster.ownership import redis_client
        from pdserve.cluster.worker_registry import RegistryUnavailable, discover_workers

        from pdserve.cluster.signing import Verdicts

        client = redis_client(args.redis_url)
        secret = getattr(args, "internal_token", None)
        warned: dict[str, float] = {}  # what was logged -> when
        verified = {"prefill": Verdicts(), "decode": Verdicts()}  # per role: entry content -> signature verdict
        why = {"malformed": "malformed", "unsigned": "not signed", "signature": "signed with another --internal-token",
               "expired": "signed too long ago"}

        def warn_once_a_minute(what: str, message: str, *args) -> None:
            # One warning per kind a minute, however many entries: registrations are read every second, a block's
            # owners on every prompt starting with it, and forged entries may be many.
            if time.monotonic() - warned.get(what, -60.0) >= 60.0:
                warned[what] = time.monotonic()
                log.warning(message, *args)

        def rejected(key: str, reason: str, info: dict) -> None:
            # Never dialled, so never sent the token.
            metrics.count(metrics.registrations_rejected, reason=reason)
            warn_once_a_minute(reason, "ignoring worker registrations that are %s, e.g. %s (worker %r, address %r); "
                               "pdserve_worker_registrations_rejected_total counts them", why[reason], key,
                               str(info.get("worker_id"))[:64], str(info.get("address"))[:64])

        def owner_rejected(reason: str, key: str) -> None:
            # Never used for routing; the prompt on that block is routed by the owners that verify, or by load.
            metrics.count(metrics.ownership_rejected, reason=reason)
            warn_once_a_minute("owner " + reason, "ignoring prefix-ownership entries that are %s, e.g. in %s; "
                               "pdserve_prefix_ownership_rejected_total counts them", why[reason], key)

        def discover(role: str):
            try:
                return [w["address"] for w in discover_workers(client, role, secret=secret, on_rejected=rejected,
                                                               verified=verified[role])]
            except RegistryUnavailable:  # Redis away: keep the workers we know
                metrics.count(metrics.redis_errors)
                return None
        ownership = OWNERSHIP_STORES.get("redis")(args.redis_url, secret=secret, on_rejected=owner_rejected)
    else:
        discover = None
        ownership = OWNERSHIP_STORES.get("memory")()
    health = HealthConfig(getattr(args, "health_check_interval", 1.0), getattr(args, "health_check_timeout", 1.0),
                          getattr(args, "health_check_misses", 2), getattr(args, "progress_timeout", 5.0),
                          getattr(args, "wait_for_worker", 5.0))
    pool = WorkerPool({"prefill": args.prefill, "decode": args.decode}, discover, health=health,
                      security=security_from_args(args),
                      on_down=lambda w, kind: metrics.count(metrics.workers_down, reason=kind))
    if args.model:  # as the workers find it: relative paths fall back to the checkout
        from pdserve.cli.engine_args import resolve_model_dir

        args.model = resolve_model_dir(args.model)
    tokenizer = Tokenizer.from_model_dir(args.model) if args.model else None
    # getattr: `pdserve up` builds these arguments itself and sets only the basic ones.
    config = RouterConfig(args.host, args.port, args.balance_threshold, records_ownership=not args.redis_url,
                          max_new_tokens_limit=getattr(args, "max_new_tokens_limit", None),
                          max_concurrent_requests=getattr(args, "max_concurrent_requests", 1024),
                          max_request_bytes=getattr(args, "max_request_bytes", 16 << 20),
                          tokenize_threads=getattr(args, "tokenize_threads", 2),
                          stream_interval=getattr(args, "stream_interval", 1),
                          warm_pairs=not getattr(args, "skip_warmup", False))
    router = Router(config, pool, ownership, metrics, tokenizer)
    mport = _serve_metrics(metrics, args.metrics_port, args.host)
    server, port = await start_router(router)
    http = None
    if args.http_port is not None:  # after gRPC: both fronts share the router, its pool and its loop
        from pdserve.router.openai_http import OpenAIHttpConfig, start_openai_http

        try:
            http, http_port = await start_openai_http(
                router, OpenAIHttpConfig(args.host, args.http_port, args.model, security=pool.security),
                drain=server._pdserve_drain)  # one drain for both fronts: SIGTERM waits for HTTP requests too
        except OSError:  # a taken port: stop the started gRPC server on this loop, then say so
            await server.stop(0)
            await pool.close()
            raise
    _say(f"router serving pdserve.v1.Generation on {args.host}:{port} with "
         f"{len(pool.of_role('prefill'))} prefill and {len(pool.of_role('decode'))} decode workers"
         + (f", OpenAI HTTP on :{http_port}" if http else "") + (f", metrics on :{mport}" if mport else ""))
    if on_ready:
        on_ready({"grpc": port, "http": http_port if http else None, "metrics": mport})

    async def stop_fronts() -> None:
        if router.warm_task is not None:
            router.warm_task.cancel()
        if http is not None:
            await http.cleanup()
        router.decode_streams.close()
        router.prefill_streams.close()
        await pool.close()
        ownership.close()
        router.checks.close()

    await serve_until_signal(server, getattr(args, "drain_timeout", 30.0), stop_fronts, stop=stop)


def cmd_router(args: argparse.Namespace) -> int:
    if not (args.prefill and args.decode) and not args.redis_url:
        from pdserve.cli.engine_args import UsageError

        raise UsageError("give workers with --prefill HOST:PORT and --decode HOST:PORT, or --redis-url to discover")
    asyncio.run(run_router(args))
    return 0


# ---- pdserve up: the whole stack on one machine -----------------------------------------------------------------
def cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when the server reports SERVING on grpc.health.v1, else 1 (what Docker's HEALTHCHECK expects: 2 is
    reserved there, so even an unreachable server is a plain 1)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = args.target or f"127.0.0.1:{args.port}"
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"{target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


# ---- pdserve generate --target: the gRPC client -----------------------------------------------------------------
def generate_remote(args: argparse.Namespace, params) -> int:
    import grpc

    from pdserve.serving.auth import bearer_metadata
    from pdserve.serving.rpc_convert import FINISH_FROM_PROTO, sampling_to_proto
    from pdserve.v1 import generate_pb2 as gen_pb
    from pdserve.v1 import generate_pb2_grpc as gen_grpc

    req = gen_pb.GenerateRequest(sampling_params=sampling_to_proto(params))
    if args.prompt is not None:
        req.text = args.prompt
    else:
        req.tokenized.input_ids.extend(args.input_ids)
    with grpc.insecure_channel(args.target) as channel:
        stub = gen_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(req, timeout=args.timeout, metadata=bearer_metadata(args.api_key)):
                if msg.HasField("chunk") and not args.json:
                    print(msg.chunk.text if args.prompt is not None else
                          " ".join(map(str, msg.chunk.token_ids)) + " ", end="", flush=True)
                if msg.HasField("complete"):
                    c = msg.complete
                    if args.json:
                        print(json.dumps({"output_ids": list(c.output_ids), "text": c.text,
                                          "finish_reason": FINISH_FROM_PROTO.get(c.finish_reason, "unspecified"),
                                          "prompt_tokens": c.usage.prompt_tokens,
                                          "completion_tokens": c.usage.completion_tokens,
                                          "cached_tokens": c.usage.cached_tokens, "request_id": msg.request_id}
                                         | ({"logprobs": [{"token_id": e.token_id, "logprob": e.logprob,
                                                           "top": [[t.token_id, t.logprob] for t in e.top]}
                                                          for e in c.logprobs]} if params.logprobs is not None
                                            else {})))
                    else:
                        print()
        except grpc.RpcError as e:
            print(f"pdserve generate: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    return 0
