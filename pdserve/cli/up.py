"""`pdserve up`: router + prefill + decode worker processes on this machine, until interrupted.

Checks every port and the model before any worker starts, starts the workers (each dies with `up` however `up`
dies), waits until each reports the port it serves on (after its warm-up), then runs the router in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
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


def _start_worker(cmd: list[str], env: dict[str, str], up_pid: int) -> tuple[subprocess.Popen, int]:
    """`cmd` with --port 0 --ready-fd: the worker binds a free port itself once it is ready and writes it to a pipe,
    whose read end is returned with the process. (A port chosen here and bound after the model load and warm-up
    could be taken meanwhile: by another program, or as the local end of any outgoing connection.)"""
    r, w = os.pipe()
    try:
        # Own session: a Ctrl-C in the terminal reaches `up` alone, which then stops the workers in order.
        proc = subprocess.Popen([*cmd, "--port", "0", "--ready-fd", str(w)], env=env, pass_fds=(w,),
                                preexec_fn=lambda: _die_with_parent(up_pid), start_new_session=True)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return proc, r


def _wait_workers(starting: list[tuple[str, subprocess.Popen, int]], timeout_s: float, note_every_s: float = 10.0,
                  stages: str = "model load, then the warm-up") -> list[int]:
    """Until every worker (its role, process and the read end of its --ready-fd pipe) has written its port, which it
    does once its model is loaded, its warm-up has run and its server is up; one line per worker when it is ready,
    and who is still starting every note_every_s (with `stages`, what a starting worker goes through). Returns the
    ports in the order of `starting`; closes the pipes."""
    start = time.monotonic()
    labels = [f"{role} worker {sum(r == role for r, _, _ in starting[:i])}" for i, (role, _, _) in enumerate(starting)]
    lines = [b""] * len(starting)
    ports: dict[int, int] = {}
    next_note = start + note_every_s
    try:
        while len(ports) < len(starting):
            waiting = [i for i in range(len(starting)) if i not in ports]
            readable, _, _ = select.select([starting[i][2] for i in waiting], [], [], 0.2)
            for i in waiting:
                role, proc, fd = starting[i]
                if fd not in readable:
                    continue
                chunk = os.read(fd, 64)
                lines[i] += chunk
                if chunk and b"\n" not in lines[i]:
                    continue  # the rest of the line is on its way
                line = lines[i].split(b"\n")[0].strip()
                if line.isdigit():
                    ports[i] = int(line)
                    _say(f"{role} worker 127.0.0.1:{ports[i]} ready after {time.monotonic() - start:.1f} s")
                    continue
                if not chunk:  # the pipe closed without a port: the worker is ending
                    try:
                        proc.wait(timeout=5.0)
                    except subprocess.TimeoutExpired:
                        pass
                if proc.poll() is not None:
                    raise RuntimeError(f"{labels[i]} exited with status {proc.returncode} while starting")
                raise RuntimeError(f"{labels[i]} (pid {proc.pid}) wrote no port to its --ready-fd pipe (it wrote "
                                   f"{lines[i][:64]!r})")
            now = time.monotonic()
            waiting = [labels[i] for i in range(len(starting)) if i not in ports]
            if waiting and now - start > timeout_s:
                raise TimeoutError(f"{', '.join(waiting)} not ready within {timeout_s:.0f} s (--start-timeout)")
            if waiting and now >= next_note:
                _say(f"still starting after {now - start:.0f} s: {', '.join(waiting)} ({stages}: their own lines "
                     "say which)")
                next_note += note_every_s
    finally:
        for _, _, fd in starting:
            os.close(fd)
    return [ports[i] for i in range(len(starting))]


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


def _bound(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and not listening, as our servers bind (no SO_REUSEPORT); OSError if it cannot
    be."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to listen on
        s.bind((host, port))
    except BaseException:
        s.close()
        raise
    return s


def _port_taken(host: str, port: int) -> Optional[str]:
    """Why `port` cannot be listened on at `host` (None when it can)."""
    try:
        _bound(host, port).close()
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


def check_up_ports(args: argparse.Namespace) -> list[socket.socket]:
    """Before any worker starts: each port valid, distinct and free, else a UsageError naming the flag. Returns the
    router's own ports bound, not listening: while they are held no worker can get one as its free port (the kernel
    hands out no port that is bound); the caller closes them just before the router listens."""
    from pdserve.cli.engine_args import UsageError

    seen: dict[int, str] = {}
    held: list[socket.socket] = []
    try:
        for flag, port in up_ports(args).items():
            if not 0 < port < 65536:
                raise UsageError(f"{flag}: {port} is not a port number (1-65535, or 0 for a free one)")
            if port in seen:
                raise UsageError(f"{seen[port]} and {flag} are both {port}: give each its own port")
            seen[port] = flag
            try:
                bound = _bound(args.host, port)
            except OSError as e:
                worker = " (worker metrics: --metrics-port + 1 + worker index)" if "+" in flag else ""
                raise UsageError(f"{flag.split('+')[0]}: cannot listen on {args.host}:{port}{worker}: "
                                 f"{e.strerror or e} (another pdserve up, or another program, holds it); pick another "
                                 f"with {flag.split('+')[0]}") from None
            if "+" in flag:  # a worker's metrics port: the worker binds it as it starts
                bound.close()
            else:
                held.append(bound)
    except BaseException:
        for bound in held:
            bound.close()
        raise
    return held


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
    held = check_up_ports(args)  # the router's ports, held until it listens on them
    try:
        return _start_and_serve(args, held)
    finally:
        for sock in held:
            sock.close()


def _start_and_serve(args: argparse.Namespace, held: list[socket.socket]) -> int:
    args.device = resolved_device(args.device)
    up_start = time.monotonic()
    from pdserve.serving.nixl_flags import check_nixl_backend

    check_nixl_backend(args.kv_transport, args.nixl_backend)  # before any worker starts, not in each of them
    layout = placement(args)
    check_cpu_backends(args, layout)
    devices = list(layout.devices)
    decode_share = decode_gpu_share(args, layout)
    starting: list[tuple[str, subprocess.Popen, int]] = []  # (role, process, read end of its --ready-fd pipe)
    up_pid = os.getpid()
    metrics_ports: list[Optional[int]] = []
    common = engine_flags(args) + ["--transfer-timeout", str(args.transfer_timeout), "--kv-transport",
                                   args.kv_transport]
    if args.redis_url:
        common += ["--redis-url", args.redis_url]
    if args.nixl_backend is not None:
        common += ["--nixl-backend", args.nixl_backend]
    env = worker_env(args, os.environ)
    try:
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(count):
                cmd = [sys.executable, "-m", "pdserve", role, "--worker-id", f"{role}-{i}", *common, "--device",
                       devices.pop(0), *role_flags(args, role, decode_share)]
                mport = None
                if not args.no_metrics:
                    mport = args.metrics_port + 1 + len(starting) if args.metrics_port else 0
                    cmd += ["--metrics-port", str(mport)]
                metrics_ports.append(mport)
                starting.append((role, *_start_worker(cmd, env, up_pid)))
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
        worker_ports = _wait_workers(starting, args.start_timeout, note_every_s=5.0,
                                     stages="model load, CUDA graphs, then the warm-up" if on_gpu
                                     else "model load, then the warm-up")
        addresses = [(role, f"127.0.0.1:{port}") for (role, _, _), port in zip(starting, worker_ports)]
        workers_ready = time.monotonic() - up_start
        router_args = argparse.Namespace(
            host=args.host, port=args.port, redis_url=args.redis_url, model=args.model,
            balance_threshold=args.balance_threshold, metrics_port=None if args.no_metrics else args.metrics_port,
            stream_interval=args.stream_interval,
            internal_token=args.internal_token, api_key=args.api_key,
            skip_warmup=getattr(args, "skip_warmup", False),
            http_port=None if args.no_http else args.http_port,
            prefill=[a for role, a in addresses if role == "prefill"],
            decode=[a for role, a in addresses if role == "decode"])

        def ready(ports: dict) -> None:
            workers = [(f"{role} worker {i if role == 'prefill' else i - args.prefill}", address,
                        metrics_ports[i] or None) for i, (role, address) in enumerate(addresses)]
            if 0 in metrics_ports:
                workers = [(w, a, None) for w, a, _ in workers]  # free ports: their own lines above name them
            try_http = (f"\n  or OpenAI: curl http://{args.host}:{ports['http']}/v1/completions -H 'Content-Type: "
                        f"application/json' -d '{{\"model\": \"{os.path.basename(args.model)}\", \"prompt\": "
                        f"\"Hello\", \"max_tokens\": 16}}'" if ports.get("http") else "")
            _say(f"pdserve is up after {time.monotonic() - up_start:.1f} s (workers ready in {workers_ready:.1f} s):\n"
                 + _endpoints_table(args, ports, workers)
                 + f"\nTry:  pdserve generate --target {args.host}:{ports['grpc']} --prompt 'Hello' "
                 "--max-new-tokens 16" + try_http + "\n(Ctrl-C stops everything)")

        for sock in held:  # the router binds them now
            sock.close()
        asyncio.run(run_router(router_args, on_ready=ready))
    except KeyboardInterrupt:  # Ctrl-C before the router took over the signals: a normal stop
        pass
    finally:
        _stop_workers([proc for _, proc, _ in starting])
    return 0


def _stop_workers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (each drains), then SIGKILL after 10 s; a second Ctrl-C meanwhile does not leave them behind."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
