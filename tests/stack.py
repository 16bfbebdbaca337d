"""Starts real pdserve processes (workers, router) on free ports for the serving tests, and talks to them."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.serving.rpc_convert import FINISH_FROM_PROTO, sampling_to_proto
from pdserve.sampling import SamplingParams
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
HOOKS_DIR = REPO / "tests" / "hooks"


def hooks_env(**variables: float) -> dict[str, str]:
    """The environment that turns test hooks on in a process a test starts (tests/hooks/sitecustomize.py lists
    them): the hooks' folder first on PYTHONPATH, and each hook's variable, e.g.
    `hooks_env(PDTEST_DECODE_SLOW_KV_ARRIVAL_S=2)`."""
    path = os.pathsep.join(p for p in (str(HOOKS_DIR), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, **{name: str(value) for name, value in variables.items()}}


_HANDED_OUT: set[int] = set()


def _port_range() -> range:
    """Where this test process takes its ports: below the kernel's ephemeral range, which it hands out for every
    port-0 bind and the local end of every outgoing connection (so none of those can take a port a test has picked
    for a process that binds it later), and a slice of its own per pytest-xdist worker (so the two never pick the
    same one). Where no room is left below that range, the ephemeral range itself."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = 15000  # above the fixed ports the tests and `pdserve up`'s defaults use (8000, 9100-9199)
    if low - first < 2000:
        return range(0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    width = (low - first) // max(workers, 1)
    return range(first + index * width, first + (index + 1) * width)


_PORTS = _port_range()
_TURN = itertools.count(os.getpid())  # (processes of other runs start elsewhere in the slice)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as our servers bind: a port in TIME_WAIT is free
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on now, never one handed out before in this process: start_all asks for the ports of
    several processes before any of them binds, and the kernel may offer a just-closed port again."""
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_TURN) % len(_PORTS)]
        if port not in _HANDED_OUT and _bindable(port):
            _HANDED_OUT.add(port)
            return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class Proc:
    role: str
    address: str
    popen: subprocess.Popen
    metrics_port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig=signal.SIGTERM) -> None:
        self.begin_stop(sig)
        self.wait_stopped()

    def begin_stop(self, sig=signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait_stopped(self) -> None:
        """Wait for the exit a signal asked for: 10 s, then SIGKILL."""
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def spawn(role: str, args: list[str], log_dir: Path, name: str, env: Optional[dict[str, str]] = None) -> Proc:
    """Start a pdserve process on free ports without waiting for it (see `wait_serving`); env: variables added to
    this process's environment (`hooks_env`)."""
    port, mport = free_port(), free_port()
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "pdserve", role, "--port", str(port), "--metrics-port", str(mport), *args]
    # One torch thread each unless the environment says otherwise: the processes of a stack and the test process
    # share the cores, and thread pools sized to every core spin against each other (as conftest's one thread, and
    # the share `pdserve up` hands its workers).
    popen = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                             env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Proc(role, f"127.0.0.1:{port}", popen, mport, log_path)


def start(role: str, args: list[str], log_dir: Path, name: str, timeout_s: float = 60.0) -> Proc:
    proc = spawn(role, args, log_dir, name)
    wait_serving(proc, timeout_s)
    return proc


def start_all(specs: list[tuple], log_dir: Path, timeout_s: float = 90.0) -> list[Proc]:
    """Start (role, args, name) or (role, args, name, env) processes side by side (their model loads overlap), then
    wait for each."""
    procs = [spawn(spec[0], spec[1], log_dir, spec[2], spec[3] if len(spec) > 3 else None) for spec in specs]
    try:
        for proc in procs:
            wait_serving(proc, timeout_s)
    except BaseException:
        stop_all(procs)
        raise
    return procs


def wait_serving(proc: Proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    # Short reconnect backoff: the port opens only after the worker's warm-up, and gRPC's default backoff (1 s growing)
    # would notice it seconds late.
    fast_retry = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 500)]
    with grpc.insecure_channel(proc.address, fast_retry) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.role} exited ({proc.popen.returncode}):\n{proc.log()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    proc.stop()
    raise TimeoutError(f"{proc.role} at {proc.address} not serving after {timeout_s}s:\n{proc.log()}")


def stop_all(procs: list[Proc]) -> None:
    """SIGTERM to every process at once, then wait for each: their graceful shutdowns overlap."""
    for p in procs:
        p.begin_stop()
    for p in procs:
        p.wait_stopped()


@dataclass
class Stack:
    prefill: list[Proc]
    decode: list[Proc]
    router: Proc
    extra: list[Proc] = field(default_factory=list)

    def all(self) -> list[Proc]:
        return self.prefill + self.decode + [self.router] + self.extra

    def stop(self) -> None:
        stop_all(self.all())


def start_pd_on_gpus(model_dir, log_dir: Path, kv_transport: str, prefill_device: str = "cuda:0",
                     decode_device: str = "cuda:1") -> Stack:
    """A router, a prefill worker on `prefill_device` and a decode worker on `decode_device` (one GPU or two) moving
    KV over `kv_transport`, in fp32 with the torch attention and MoE (whose GPU tokens equal the CPU reference's)."""
    common = ["--model", str(model_dir), "--page-size", "4", "--num-pages", "512", "--kv-transport", kv_transport,
              "--dtype", "float32", "--attention-backend", "torch", "--moe-backend", "torch"]
    prefill, decode = start_all([
        ("prefill", [*common, "--device", prefill_device, "--worker-id", "prefill-0"], "prefill-0"),
        ("decode", [*common, "--device", decode_device, "--worker-id", "decode-0"], "decode-0"),
    ], log_dir, timeout_s=180)
    try:
        router = start("router", ["--model", str(model_dir), "--prefill", prefill.address, "--decode",
                                  decode.address], log_dir, "router")
    except BaseException:
        stop_all([prefill, decode])
        raise
    return Stack([prefill], [decode], router)


def metric(port: int, name: str, **labels) -> float:
    """The sum of a metric's samples with these labels on a server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def start_stack(model_dir, log_dir: Path, n_prefill=1, n_decode=1, engine_args=(), redis_url=None,
                decode_args=(), router_args=(), timeout_s: float = 90.0, prefill_env: Optional[dict] = None,
                decode_env: Optional[dict] = None, prefill_args=()) -> Stack:
    """timeout_s: how long each worker may take to start (GPU workers warm up first). prefill_env, decode_env: added
    to the environment of those workers (`hooks_env`)."""
    common = ["--model", str(model_dir), "--page-size", "4", "--num-pages", "512", *engine_args]
    if redis_url:
        common += ["--redis-url", redis_url]
    # The workers start side by side (each spends seconds importing torch and loading the model); the router
    # after them, so that its first poll finds every worker serving.
    specs = [("prefill", [*common, *prefill_args, "--worker-id", f"prefill-{i}"], f"prefill-{i}", prefill_env)
             for i in range(n_prefill)]
    specs += [("decode", [*common, *decode_args, "--worker-id", f"decode-{i}"], f"decode-{i}", decode_env)
              for i in range(n_decode)]
    procs = start_all(specs, log_dir, timeout_s)
    prefill, decode = procs[:n_prefill], procs[n_prefill:]
    workers = []
    if redis_url:
        workers = ["--redis-url", redis_url]
    else:
        for p in prefill:
            workers += ["--prefill", p.address]
        for d in decode:
            workers += ["--decode", d.address]
    try:
        router = start("router", ["--model", str(model_dir), *workers, *router_args], log_dir, "router")
    except BaseException:
        stop_all(procs)
        raise
    return Stack(prefill, decode, router)


def router_over(workers: Stack, model_dir, log_dir: Path, router_args=()) -> Stack:
    """A router of its own (router_args: its flags) over the workers of another stack (conftest's shared_stack), as
    a Stack; stop only its router (`stop_all([s.router])`): the workers are the other stack's."""
    addresses = [flag for p in workers.prefill for flag in ("--prefill", p.address)]
    addresses += [flag for d in workers.decode for flag in ("--decode", d.address)]
    router = start("router", ["--model", str(model_dir), *addresses, *router_args], log_dir, "router")
    return Stack(workers.prefill, workers.decode, router)


@dataclass
class Result:
    output_ids: list[int]
    streamed_ids: list[int]
    text: str
    streamed_text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def generate(address: str, prompt, params: SamplingParams, timeout: float = 60.0) -> Result:
    req = gen_pb.GenerateRequest(sampling_params=sampling_to_proto(params))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokenized.input_ids.extend(prompt)
    streamed, text = [], []
    with grpc.insecure_channel(address) as ch:
        for msg in gen_grpc.GenerationStub(ch).Generate(req, timeout=timeout):
            if msg.HasField("chunk"):
                streamed += msg.chunk.token_ids
                text.append(msg.chunk.text)
            else:
                c = msg.complete
                return Result(list(c.output_ids), streamed, c.text, "".join(text),
                              FINISH_FROM_PROTO.get(c.finish_reason, "unspecified"), c.usage.prompt_tokens,
                              c.usage.cached_tokens, c.usage.completion_tokens)
    raise AssertionError("the stream ended without a complete message")


def decode_updates(stub: pb_grpc.DecodeWorkerStub, request_id: str, timeout: float = 30.0) -> list[pb.DecodeUpdate]:
    """Attach request_id on a DecodeStream call of its own and read its updates up to its last one (finished or
    failed), as a router does."""
    updates: list[pb.DecodeUpdate] = []
    call = stub.DecodeStream(iter([pb.DecodeStreamRequest(attach=[request_id])]), timeout=timeout)
    try:
        for msg in call:
            for u in msg.updates:
                assert u.request_id == request_id, u
                updates.append(u)
                if u.HasField("failure") or u.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                    return updates
    finally:
        call.cancel()
    raise AssertionError(f"the DecodeStream call ended before {request_id}'s last update: {updates}")


def load(proc: Proc) -> pb.WorkerLoad:
    stub_cls = pb_grpc.PrefillWorkerStub if proc.role == "prefill" else pb_grpc.DecodeWorkerStub
    with grpc.insecure_channel(proc.address) as ch:
        return stub_cls(ch).GetLoad(pb.GetLoadRequest(), timeout=5)


def wait_idle(proc: Proc, timeout_s: float = 10.0) -> pb.WorkerLoad:
    """Until the worker holds no pages for requests (prefix-cache pages count as free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = load(proc)
        idle = (current.num_free_pages == current.num_total_pages and current.num_running_requests == 0
                and current.num_waiting_requests == 0 and current.num_transferring == 0)
        if idle or time.monotonic() > deadline:
            return current
        time.sleep(0.1)


def scrape(proc: Proc) -> str:
    import urllib.request

    return urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
