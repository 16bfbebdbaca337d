"""`pdserve up`: router + prefill + decode worker processes on this machine, until interrupted.

Checks every port and the model before any worker starts, starts the workers (each dies with `up` however `up`
dies), waits until each reports SERVING (after its warm-up), then runs the router in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Optional

from pdserve.cli.engine_args import DEFAULT_MODEL_DIR
from pdserve.cli.serve import _say, run_router

# The random tiny model `up` makes when a checkout lacks the committed demo model (DEFAULT_MODEL_DIR).
FALLBACK_MODEL_DIR = os.path.join("models", "tiny-deepseek-v3")

if TYPE_CHECKING:
    from pdserve.cli.gpu_layout import Placement


def _free_port(avoid: frozenset[int] = frozenset()) -> int:
    """A free port, never one of `avoid` (the fixed ports `up` has yet to bind)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def _wait_workers(procs: list[tuple[str, subprocess.Popen]], timeout_s: float, note_every_s: float = 10.0,
                  stages: str = "model load, then the warm-up") -> None:
    """Until every worker ("role:host:port", process) reports SERVING, which it does once its model is loaded and
    its warm-up has run; one line per worker when it is ready, and who is still starting every note_every_s (with
    `stages`, what a starting worker goes through)."""
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
                _say(f"still starting after {now - start:.0f} s: {', '.join(waiting)} ({stages}: their own lines "
                     "say which)")
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
             "--max-running-requests", str(args.max_running_requests), "--max-model-len", str(args.max_model_len),
             "--tp", str(args.tp), "--ep", str(args.ep), "--collective-timeout", str(args.collective_timeout)]
    flags += ["--cuda-graph-max-bs", str(args.cuda_graph_max_bs)]
    if args.speculative_algorithm:  # decode rows speculate; prefill workers then compute the MTP layer's prompt KV
        flags += ["--speculative-algorithm", args.speculative_algorithm, "--speculative-num-steps",
                  str(args.speculative_num_steps)]
        if args.speculative_num_draft_tokens is not None:
            flags += ["--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens)]
    return flags + (["--no-prefix-cache"] if args.no_prefix_cache else []) + (
        ["--disable-cuda-graph"] if args.disable_cuda_graph else []) + (
        ["--skip-warmup"] if getattr(args, "skip_warmup", False) else [])


def role_flags(args: argparse.Namespace, role: str, decode_share: float = 1.0) -> list[str]:
    """The flags of `up` that go to one tier's workers only."""
    if role == "prefill":
        return ["--no-kv-layerwise"] if args.no_kv_layerwise else []
    flags = ["--dp-attention"] if args.dp_attention else []  # (a prefill worker's KV leaves after each prompt)
    if args.min_step_interval_ms:
        flags += ["--min-step-interval-ms", str(args.min_step_interval_ms)]
    if decode_share < 1:
        flags += ["--gpu-share-while-prefilling", repr(decode_share)]
    return flags


def worker_env(args: argparse.Namespace, environ) -> dict[str, str]:
    """The workers' environment. On the CPU each worker gets its share of the cores for torch's thread pool (unless
    OMP_NUM_THREADS is set): every process sizing its pool to all cores makes them spin against each other. The
    internal token, when `up` has one, reaches them here."""
    env = dict(environ)
    # NOTE: the token goes in the environment (PDSERVE_INTERNAL_TOKEN, what the workers' --internal-token defaults
    # to), not on their command lines, which every local user can list.
    if getattr(args, "internal_token", None):
        env["PDSERVE_INTERNAL_TOKEN"] = args.internal_token
    if args.device == "cpu" and "OMP_NUM_THREADS" not in env:
        ranks = (args.prefill + args.decode) * getattr(args, "tp", 1)  # a tensor-parallel worker: --tp processes
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    return env


def placement(args: argparse.Namespace) -> "Placement":
    """Each worker's device from --device, --kv-transport and the GPU-list flags (pdserve/cli/gpu_layout.py)."""
    from pdserve.cli.gpu_layout import place_workers

    explicit = any(getattr(args, f, None) is not None for f in ("gpus", "prefill_gpus", "decode_gpus"))
    tp = getattr(args, "tp", 1)
    gpu_count = 0
    if args.device.startswith("cuda") and (explicit or args.kv_transport == "nccl" or tp > 1):
        import torch

        gpu_count = torch.cuda.device_count()
    return place_workers(args.device, args.prefill, args.decode, args.kv_transport, gpu_count,
                         getattr(args, "gpus", None), getattr(args, "prefill_gpus", None),
                         getattr(args, "decode_gpus", None), tp)


# --decode-gpu-share auto, when a decode worker shares its GPU with a prefill worker: while prompts wait and the GPU is
# contended, a decode step's GPU time is at most a third of the time between steps (benchmarks/results, knobs).
SHARED_GPU_DECODE_SHARE = 1 / 3


def decode_gpu_share(args: argparse.Namespace, layout: Optional["Placement"] = None) -> float:
    """--decode-gpu-share resolved. auto: a third where a decode worker shares its GPU with a prefill worker, else 1
    (no limit), as on the CPU, where there is nothing to limit (only CUDA graph replays are timed)."""
    if args.decode_gpu_share != "auto":
        return args.decode_gpu_share
    if layout is None:  # without a layout: workers share --device unless nccl gave each its own GPU
        return 1.0 if args.kv_transport == "nccl" else SHARED_GPU_DECODE_SHARE
    return SHARED_GPU_DECODE_SHARE if layout.shares_gpu else 1.0


def resolved_device(device: str) -> str:
    """--device auto as each worker resolves it (cuda when torch sees a GPU), so that `up` plans and reports the
    real device. NOTE: without an NVIDIA or ROCm driver's device files no GPU can be seen, and the answer needs no
    torch, whose import costs the router's process seconds and memory."""
    if device != "auto":
        return device
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd")):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_cpu_backends(args: argparse.Namespace, layout: "Placement") -> None:
    """A kernel backend named on the command line that cannot run on the CPU: its reason (exit 2) before any worker
    starts, instead of every worker's. On a GPU each worker checks its own (deep_gemm with a probe that takes
    seconds, once per process)."""
    named = {kind: name for kind, name in (("attention", args.attention_backend), ("moe", args.moe_backend),
                                           ("gemm", args.gemm_backend)) if name != "auto"}
    if not named or set(layout.devices) != {"cpu"}:
        return
    from pdserve.kernels.backends import validate_backend

    for kind, name in named.items():
        validate_backend(kind, name, "cpu")


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
    args.device = resolved_device(args.device)
    fixed_ports = frozenset(up_ports(args).values())
    up_start = time.monotonic()
    from pdserve.serving.nixl_flags import check_nixl_backend

    check_nixl_backend(args.kv_transport, args.nixl_backend)  # before any worker starts, not in each of them
    layout = placement(args)
    check_cpu_backends(args, layout)
    devices = list(layout.devices)
    decode_share = decode_gpu_share(args, layout)
    procs: list[tuple[str, subprocess.Popen]] = []
    up_pid = os.getpid()
    worker_metrics: dict[str, Optional[int]] = {}
    common = engine_flags(args) + ["--transfer-timeout", str(args.transfer_timeout), "--kv-transport",
                                   args.kv_transport]
    if args.redis_url:
        common += ["--redis-url", args.redis_url]
    if args.nixl_backend is not None:
        common += ["--nixl-backend", args.nixl_backend]
    env = worker_env(args, os.environ)
    try:
        k = 0
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(count):
                port = _free_port(fixed_ports)
                cmd = [sys.executable, "-m", "pdserve", role, "--port", str(port), "--worker-id",
                       f"{role}-{i}", *common, "--device", devices.pop(0), *role_flags(args, role, decode_share)]
                name = f"{role}:127.0.0.1:{port}"
                if not args.no_metrics:
                    mport = args.metrics_port + 1 + k if args.metrics_port else 0
                    cmd += ["--metrics-port", str(mport)]
                    worker_metrics[name] = mport or None
                k += 1
                # Own session: a Ctrl-C in the terminal reaches `up` alone, which then stops the workers in order.
                procs.append((name, subprocess.Popen(cmd, env=env, preexec_fn=lambda: _die_with_parent(up_pid),
                                                       start_new_session=True)))
        _say(f"starting {args.prefill} prefill and {args.decode} decode workers on {args.model}; each loads the "
             "model, then runs its warm-up, then reports ready ...")
        for line in layout.describe(args.kv_transport):
            _say(line)
        if args.dp_attention:
            _say(f"decode workers: DP attention over their {args.tp} ranks (each rank its own requests and KV pool); "
                 "prefill workers: plain --tp")
        on_gpu = any(d.startswith("cuda") for d in layout.devices)
        if decode_share < 1 and on_gpu:
            _say(f"while prompts are being prefilled, decode steps keep to {decode_share:.2g} of the GPU's time "
                 "(--decode-gpu-share; 1 = back to back)")
        _wait_workers(procs, args.start_timeout, note_every_s=5.0,
                      stages="model load, CUDA graphs, then the warm-up" if on_gpu else "model load, then the warm-up")
        workers_ready = time.monotonic() - up_start
        router_args = argparse.Namespace(
            host=args.host, port=args.port, redis_url=args.redis_url, model=args.model,
            balance_threshold=args.balance_threshold, metrics_port=None if args.no_metrics else args.metrics_port,
            stream_interval=args.stream_interval,
            internal_token=args.internal_token, api_key=args.api_key,
            skip_warmup=getattr(args, "skip_warmup", False),
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
