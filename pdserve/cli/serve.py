"""`pdserve prefill | decode | router | up` and the gRPC client side of `pdserve generate --target`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Optional

from pdserve.cli.choices import LazyChoices

log = logging.getLogger("pdserve")
# The committed demo model (scripts/train_tiny.py: trained on Python's standard library, with an MTP layer that
# NextN speculation accepts); the random tiny model is made only if a checkout lacks it.
from pdserve.cli.engine_args import DEFAULT_MODEL_DIR  # noqa: E402

FALLBACK_MODEL_DIR = os.path.join("models", "tiny-deepseek-v3")


def _say(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group(f"{role} worker")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=0, help="gRPC port (0 = a free one, printed at start)")
    g.add_argument("--advertise-host", default=None, help="host peers should dial (default: --host)")
    g.add_argument("--worker-id", default=None, help="stable id (default: role-hostname-pid-random)")
    g.add_argument("--kv-transport", default="tcp", choices=LazyChoices(kv_transport_names),
                   help=KV_TRANSPORT_HELP)
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
    g.add_argument("--max-queued-requests", type=int, default=256, metavar="N",
                   help="requests waiting here (prefill: for compute; decode: for their KV) before new ones get "
                        "RESOURCE_EXHAUSTED (default 256)")
    add_warmup_args(g)
    # TEST HOOK (tests/test_ready.py): the engine's first forward sleeps S seconds, standing for a cold GPU's kernel
    # compiles. Hidden; PDSERVE_TEST_HOOK_SLOW_FIRST_FORWARD sets it in every worker `pdserve up` starts.
    g.add_argument("--test-hook-slow-first-forward", type=float, default=0.0, metavar="S", help=argparse.SUPPRESS)
    add_reliability_args(p, internal_server=True)


def add_warmup_args(g) -> None:
    g.add_argument("--skip-warmup", action="store_true",
                   help="report SERVING without first running each prompt size and decode batch once (on a GPU the "
                        "first requests then wait for kernel compiles; for tests that do not need it)")


KV_TRANSPORT_HELP = (
    "how KV moves from prefill to decode: tcp (default): through the host, any device; auto picks cuda_ipc when "
    "the two workers are on one host and the prefill GPU can write to the decode pool's GPU (the same GPU, or peer "
    "access), else tcp (NOTE: cuda_ipc has not run on a GPU yet, so it is not the default); the choice is "
    "logged when a pair first connects and is the `transport` label of pdserve_kv_transfer_*. cuda_ipc: the prefill "
    "worker writes into the decode pool over CUDA IPC (same host, refused otherwise); "
    "nccl: GPU to GPU over NCCL, two different GPUs (never picked by auto); gloo: CPU pools. Both tiers "
    "take the same value, or auto on either side of tcp or cuda_ipc")


def kv_transport_names() -> list[str]:
    from pdserve.kv_transfer import TRANSPORTS

    return TRANSPORTS.names()


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


def _startup_times(start: float, built: float, warmup) -> str:
    """' (ready in 9.1 s: engine 3.2 s, warm-up 5.9 s)': where a worker's start-up went."""
    parts = [f"engine {built:.1f} s"] + ([f"warm-up {warmup.seconds:.1f} s"] if warmup else ["no warm-up"])
    return f" (ready in {time.monotonic() - start:.1f} s: {', '.join(parts)})"


def cmd_prefill(args: argparse.Namespace) -> int:
    from pdserve.cli.engine_args import engine_config_from_args
    from pdserve.serving.metrics import Metrics
    from pdserve.prefill_service.publisher import OwnershipPublisher
    from pdserve.prefill_service.server import PrefillWorker, PrefillWorkerConfig, serve_prefill

    _nccl_error_handling(args)
    _show_kv_pairings()
    start = time.monotonic()
    metrics = Metrics.create("prefill")
    mport = _serve_metrics(metrics, args.metrics_port, args.host)  # first: a taken port fails before the model loads
    config = PrefillWorkerConfig(engine_config_from_args(args, prefill_only=True), host=args.host, port=args.port,
                                 kv_transport=args.kv_transport, kv_layerwise=not args.no_kv_layerwise,
                                 transfer_timeout_s=args.transfer_timeout,
                                 max_queued_requests=args.max_queued_requests, drain_timeout_s=args.drain_timeout,
                                 security=security_from_args(args), warmup=not args.skip_warmup,
                                 test_hook_slow_first_forward_s=args.test_hook_slow_first_forward)
    worker = PrefillWorker(config, _identity(args, "prefill", args.port), metrics)
    built = time.monotonic() - start
    state = {}

    def ready(port: int) -> None:
        worker.identity = dataclasses.replace(worker.identity, address=_identity(args, "prefill", port).address)
        if args.redis_url:
            from pdserve.cluster.ownership import RedisOwnership

            store = RedisOwnership(args.redis_url)
            try:  # a restarted worker with a stable id holds nothing yet
                store.drop_worker(worker.identity.worker_id)
            except Exception as e:
                log.warning("could not clear old prefix ownership in Redis: %s", e)
            state["publisher"] = OwnershipPublisher(store, worker.identity.worker_id, metrics).start()
            worker.publishers.append(state["publisher"])
        state["registration"] = _register(args, worker, "prefill", mport)
        _say(f"prefill worker {worker.identity.worker_id} serving on {worker.identity.address}"
             + (f", metrics on :{mport}" if mport else "") + _startup_times(start, built, worker.warmup_report))

    asyncio.run(serve_prefill(worker, ready=ready))
    for key in ("registration", "publisher"):
        if state.get(key):
            state[key].stop()
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from pdserve.cli.engine_args import engine_config_from_args
    from pdserve.decode_service.server import DecodeWorker, DecodeWorkerConfig, serve_decode
    from pdserve.serving.metrics import Metrics, SpecMetrics

    _nccl_error_handling(args)
    _show_kv_pairings()
    start = time.monotonic()
    metrics = Metrics.create("decode")
    mport = _serve_metrics(metrics, args.metrics_port, args.host)  # first: a taken port fails before the model loads
    engine = engine_config_from_args(args)
    # Decode keeps no prefix cache: its pages come from prefill and return to the pool when a request ends.
    engine = dataclasses.replace(engine, scheduler=dataclasses.replace(engine.scheduler, enable_prefix_cache=False))
    config = DecodeWorkerConfig(engine, host=args.host, port=args.port, kv_host=args.kv_host or args.host,
                                kv_port=args.kv_port, kv_transport=args.kv_transport,
                                transfer_timeout_s=args.transfer_timeout,
                                max_queued_requests=args.max_queued_requests, drain_timeout_s=args.drain_timeout,
                                security=security_from_args(args), warmup=not args.skip_warmup,
                                test_hook_slow_first_forward_s=args.test_hook_slow_first_forward)
    worker = DecodeWorker(config, _identity(args, "decode", args.port), metrics)
    built = time.monotonic() - start
    worker.core.spec_observer = SpecMetrics(metrics)  # pdserve_spec_* histograms (recorded only when speculating)
    state = {}

    def ready(port: int) -> None:
        worker.identity = dataclasses.replace(worker.identity, address=_identity(args, "decode", port).address)
        state["registration"] = _register(args, worker, "decode", mport)
        _say(f"decode worker {worker.identity.worker_id} serving on {worker.identity.address}, KV receiver on "
             f"{worker.receiver.endpoint}" + (f", metrics on :{mport}" if mport else "")
             + _startup_times(start, built, worker.warmup_report))

    asyncio.run(serve_decode(worker, ready=ready))
    if state.get("registration"):
        state["registration"].stop()
    return 0


def add_router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=50051, help="client gRPC port (default 50051)")
    g.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", help="a prefill worker (repeat)")
    g.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="a decode worker (repeat)")
    g.add_argument("--redis-url", default=None,
                   help="discover workers and read prefix ownership from Redis (else in-process ownership)")
    g.add_argument("--model", default=None, metavar="DIR", help="model directory for the tokenizer (text prompts)")
    g.add_argument("--balance-threshold", type=int, default=4,
                   help="extra requests tolerated on the prefix owner before load decides (default 4)")
    g.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
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
    add_reliability_args(p, internal_server=False).add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help="require 'authorization: Bearer KEY' from clients (repeatable: any of the keys)")


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

        client = redis_client(args.redis_url)
        secret = getattr(args, "internal_token", None)
        warned: dict[str, float] = {}

        def rejected(key: str, reason: str, info: dict) -> None:
            # Never dialled, so never sent the token. One warning per entry a minute: the check runs every second.
            metrics.count(metrics.registrations_rejected, reason=reason)
            if time.monotonic() - warned.get(key, -60.0) >= 60.0:
                warned[key] = time.monotonic()
                log.warning("ignoring worker registration %s (%s): %s, address %r", key, info.get("worker_id"),
                            {"unsigned": "not signed", "signature": "signature does not verify with "
                             "--internal-token", "expired": "signed too long ago"}[reason], info.get("address"))

        def discover(role: str):
            try:
                return [w["address"] for w in discover_workers(client, role, secret=secret, on_rejected=rejected)]
            except RegistryUnavailable:  # Redis away: keep the workers we know
                metrics.count(metrics.redis_errors)
                return None
        ownership = OWNERSHIP_STORES.get("redis")(args.redis_url)
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
                          tokenize_threads=getattr(args, "tokenize_threads", 2))
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
        if http is not None:
            await http.cleanup()
        await pool.close()
        ownership.close()

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


def _free_port(avoid: frozenset[int] = frozenset()) -> int:
    """A free port, never one of `avoid` (the fixed ports `up` has yet to bind)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def _wait_workers(procs: list[tuple[str, subprocess.Popen]], timeout_s: float, note_every_s: float = 10.0) -> None:
    """Until every worker ("role:host:port", process) reports SERVING, which it does once its model is loaded and
    its warm-up has run; one line per worker when it is ready, and who is still starting every note_every_s."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    start = time.monotonic()
    waiting = dict(procs)
    # NOTE: a port that opens only after the warm-up: gRPC's default reconnect backoff (1 s growing to 120 s) would
    # notice it up to a minute late.
    fast_retry = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 500)]
    channels = {name: grpc.insecure_channel(name.split(":", 1)[1], fast_retry) for name in waiting}
    next_note = start + note_every_s
    try:
        while waiting:
            for name, proc in list(waiting.items()):
                role, address = name.split(":", 1)
                if proc.poll() is not None:
                    raise RuntimeError(f"{role} worker at {address} exited with status {proc.returncode} while "
                                       "starting")
                try:
                    serving = health_pb2_grpc.HealthStub(channels[name]).Check(
                        health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:  # its port opens after the warm-up
                    serving = False
                if serving:
                    del waiting[name]
                    _say(f"{role} worker {address} ready after {time.monotonic() - start:.1f} s")
            now = time.monotonic()
            if waiting and now - start > timeout_s:
                raise TimeoutError(f"workers {', '.join(n.split(':', 1)[1] for n in waiting)} not ready within "
                                   f"{timeout_s:.0f} s (--start-timeout)")
            if waiting and now >= next_note:
                _say(f"still starting after {now - start:.0f} s: {', '.join(waiting)} (model load, CUDA graphs, "
                     "then the warm-up: their own lines say which)")
                next_note += note_every_s
            if waiting:
                time.sleep(0.2)
    finally:
        for channel in channels.values():
            channel.close()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of `up`, forwarded to each worker process."""
    flags = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--load-format",
             args.load_format, "--attention-backend", args.attention_backend, "--moe-backend", args.moe_backend,
             "--gemm-backend", args.gemm_backend, "--page-size", str(args.page_size), "--num-pages",
             str(args.num_pages), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-running-requests", str(args.max_running_requests)]
    flags += ["--cuda-graph-max-bs", str(args.cuda_graph_max_bs)]
    if args.speculative_algorithm:  # prefill workers accept and ignore them: only decode rows speculate
        flags += ["--speculative-algorithm", args.speculative_algorithm, "--speculative-num-steps",
                  str(args.speculative_num_steps)]
        if args.speculative_num_draft_tokens is not None:
            flags += ["--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens)]
    return flags + (["--no-prefix-cache"] if args.no_prefix_cache else []) + (
        ["--disable-cuda-graph"] if args.disable_cuda_graph else []) + (
        ["--skip-warmup"] if getattr(args, "skip_warmup", False) else [])


def _gpu_per_worker(args: argparse.Namespace) -> Optional[list[str]]:
    """nccl pairs two GPUs (NCCL refuses two ranks on one device): `up` then puts worker k on cuda:k."""
    if args.kv_transport != "nccl":
        return None
    import torch

    need, have = args.prefill + args.decode, torch.cuda.device_count()
    if have < need:
        from pdserve.cli.engine_args import UsageError

        raise UsageError(f"--kv-transport nccl puts each worker on its own GPU: {need} workers need {need} GPUs, "
                         f"this machine has {have} (use tcp, or fewer workers)")
    return [f"cuda:{k}" for k in range(need)]


def _die_with_parent(parent: int) -> None:
    """In a worker `up` starts, before it execs: Linux sends it SIGTERM when `up` dies, however it dies (SIGKILL
    included), so no worker outlives its stack holding ports and memory (Linux only: prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # NOTE: `up` died between the fork and the prctl: no signal will come
            os._exit(1)


def _port_taken(host: str, port: int) -> Optional[str]:
    """Why `port` cannot be listened on at `host` (None when it can): a bind without SO_REUSEPORT, as our servers
    now bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to listen on
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def up_ports(args: argparse.Namespace) -> dict[str, int]:
    """Every fixed port `up` will listen on, by the flag that chose it ("--port", "--http-port", "--metrics-port",
    "--metrics-port+1" for worker 0, ...); 0 (a free one) is left out."""
    ports = {"--port": args.port}
    if not args.no_http:
        ports["--http-port"] = args.http_port
    if not args.no_metrics:
        ports["--metrics-port"] = args.metrics_port
        if args.metrics_port:
            for k in range(args.prefill + args.decode):
                ports[f"--metrics-port+{k + 1}"] = args.metrics_port + 1 + k
    return {flag: port for flag, port in ports.items() if port}


def check_up_ports(args: argparse.Namespace) -> None:
    """Before any worker starts: each port valid, distinct and free, else a UsageError naming the flag."""
    from pdserve.cli.engine_args import UsageError

    seen: dict[int, str] = {}
    for flag, port in up_ports(args).items():
        if not 0 < port < 65536:
            raise UsageError(f"{flag}: {port} is not a port number (1-65535, or 0 for a free one)")
        if port in seen:
            raise UsageError(f"{seen[port]} and {flag} are both {port}: give each its own port")
        seen[port] = flag
        why = _port_taken(args.host, port)
        if why:
            worker = " (worker metrics: --metrics-port + 1 + worker index)" if "+" in flag else ""
            raise UsageError(f"{flag.split('+')[0]}: cannot listen on {args.host}:{port}{worker}: {why} (another "
                             f"pdserve up, or another program, holds it); pick another with {flag.split('+')[0]}")


def _endpoints_table(args: argparse.Namespace, ports: dict, workers: list[tuple[str, str, Optional[int]]]) -> str:
    host = args.host
    rows = [("router gRPC (pdserve.v1.Generation, health, reflection)", f"{host}:{ports['grpc']}")]
    if ports.get("http"):
        rows.append(("OpenAI HTTP API", f"http://{host}:{ports['http']}/v1"))
    if ports.get("metrics"):
        rows.append(("router metrics", f"http://{host}:{ports['metrics']}/metrics"))
    for name, address, mport in workers:
        rows.append((f"{name} gRPC", address))
        if mport:
            rows.append((f"{name} metrics", f"http://127.0.0.1:{mport}/metrics"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {what:<{width}}  {where}" for what, where in rows)


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.cli.engine_args import UsageError, resolve_model_dir

    if args.prefill < 1 or args.decode < 1:
        raise UsageError("--prefill and --decode must each be at least 1")
    if args.model is None and not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        args.model = FALLBACK_MODEL_DIR
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            from pdserve.tiny_model import make_tiny_model

            _say(f"no --model given and no trained demo model: making a random tiny model in {args.model}")
            make_tiny_model(args.model)
    args.model = resolve_model_dir(args.model)  # before any worker starts, as are the ports
    check_up_ports(args)
    fixed_ports = frozenset(up_ports(args).values())
    up_start = time.monotonic()
    gpus = _gpu_per_worker(args)
    procs: list[tuple[str, subprocess.Popen]] = []
    up_pid = os.getpid()
    worker_metrics: dict[str, Optional[int]] = {}
    common = engine_flags(args) + ["--transfer-timeout", str(args.transfer_timeout), "--kv-transport",
                                   args.kv_transport]
    if args.redis_url:
        common += ["--redis-url", args.redis_url]
    try:
        k = 0
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(count):
                port = _free_port(fixed_ports)
                cmd = [sys.executable, "-m", "pdserve", role, "--port", str(port), "--worker-id",
                       f"{role}-{i}", *common] + (["--device", gpus.pop(0)] if gpus else [])
                name = f"{role}:127.0.0.1:{port}"
                if not args.no_metrics:
                    mport = args.metrics_port + 1 + k if args.metrics_port else 0
                    cmd += ["--metrics-port", str(mport)]
                    worker_metrics[name] = mport or None
                k += 1
                # Own session: a Ctrl-C in the terminal reaches `up` alone, which then stops the workers in order.
                procs.append((name, subprocess.Popen(cmd, preexec_fn=lambda: _die_with_parent(up_pid),
                                                       start_new_session=True)))
        _say(f"starting {args.prefill} prefill and {args.decode} decode workers on {args.model} ({args.device}); "
             "each loads the model, then runs its warm-up, then reports ready ...")
        _wait_workers(procs, args.start_timeout, note_every_s=5.0)
        workers_ready = time.monotonic() - up_start
        router_args = argparse.Namespace(
            host=args.host, port=args.port, redis_url=args.redis_url, model=args.model,
            balance_threshold=args.balance_threshold, metrics_port=None if args.no_metrics else args.metrics_port,
            http_port=None if args.no_http else args.http_port,
            prefill=[n.split(":", 1)[1] for n, _ in procs if n.startswith("prefill")],
            decode=[n.split(":", 1)[1] for n, _ in procs if n.startswith("decode")])

        def n_of_role(name: str) -> int:
            role = name.split(":")[0]
            return [n for n, _ in procs if n.startswith(role + ":")].index(name)

        def ready(ports: dict) -> None:
            workers = [(f"{n.split(':')[0]} worker {n_of_role(n)}", n.split(":", 1)[1], worker_metrics.get(n))
                       for n, _ in procs]
            if any(m == 0 for m in worker_metrics.values()):
                workers = [(w, a, None) for w, a, _ in workers]  # free ports: their own lines above name them
            try_http = (f"\n  or OpenAI: curl http://{args.host}:{ports['http']}/v1/completions -H 'Content-Type: "
                        f"application/json' -d '{{\"model\": \"{os.path.basename(args.model)}\", \"prompt\": "
                        f"\"Hello\", \"max_tokens\": 16}}'" if ports.get("http") else "")
            _say(f"pdserve is up after {time.monotonic() - up_start:.1f} s (workers ready in {workers_ready:.1f} s):\n"
                 + _endpoints_table(args, ports, workers)
                 + f"\nTry:  pdserve generate --target {args.host}:{ports['grpc']} --prompt 'Hello' "
                 "--max-new-tokens 16" + try_http + "\n(Ctrl-C stops everything)")

        asyncio.run(run_router(router_args, on_ready=ready))
    except KeyboardInterrupt:  # Ctrl-C before the router took over the signals: a normal stop
        pass
    finally:
        _stop_workers(procs)
    return 0


def _stop_workers(procs: list[tuple[str, subprocess.Popen]]) -> None:
    """SIGTERM (each drains), then SIGKILL after 10 s; a second Ctrl-C meanwhile does not leave them behind."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for _, proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for _, proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- pdserve generate --target: the gRPC client -----------------------------------------------------------------
def generate_remote(args: argparse.Namespace, params) -> int:
    import grpc

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
            for msg in stub.Generate(req, timeout=args.timeout):
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
