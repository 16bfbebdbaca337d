"""The decode worker process: the gRPC DecodeWorker service (Reserve, DecodeStream) over the worker's engine side
(engine_side.py: the engine, its thread, and the KV receiver prefill workers stream into), on a thread of this
process or in an engine process of its own (--engine-process)."""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import grpc

from pdserve.common.trace import mark
from pdserve.engine import EngineConfig
from pdserve.kv_transfer import check_transport_device
from pdserve.serving.auth import SecurityConfig, internal_auth
from pdserve.serving.engine_link import EngineOnThread, EngineProcess
from pdserve.serving.grpc_shell import (
    Drain, ServiceError, abort_with, create_server, invalid, serve_until_signal, start_serving, stop_on_signals,
)
from pdserve.serving.metrics import Metrics
from pdserve.serving.rpc_convert import layout_to_proto, sampling_from_proto
from pdserve.serving.worker_common import WorkerControl, WorkerIdentity
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from .engine_side import DecodeEngineSide, DecodeSideInfo, build_in_engine_process
from .streams import Connection, StreamHub

log = logging.getLogger(__name__)
# A reservation that no DecodeStream call has attached this long after Reserve answered is released: the router
# attaches right after the answer, so its absence means the request ended (deadline, cancel, router gone).
RESERVATION_ATTACH_S = 1.0


@dataclass(frozen=True)
class DecodeWorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_transport: str = "tcp"
    transfer_timeout_s: float = 300.0
    max_queued_requests: int = 256  # reserved requests waiting for their KV; beyond: RESOURCE_EXHAUSTED at once
    drain_timeout_s: float = 30.0  # on SIGTERM, how long requests in flight may take to finish
    security: SecurityConfig = SecurityConfig()
    warmup: bool = True  # run the warm-up (pdserve/serving/warmup.py) before the port opens
    # Pacing (decode_service/pacing.py), while prompts bound here are still being prefilled: a step starts at most
    # this often (0: at once), and its graphs' GPU time is at most this share of the time to the next (1: any).
    # On a GPU shared with the prefill worker, fewer and fuller decode steps leave it more of the GPU.
    min_step_interval_s: float = 0.0
    gpu_share_while_prefilling: float = 1.0
    test_hook_slow_first_forward_s: float = 0.0  # TEST HOOK: the first forward sleeps this long (a cold compile)
    test_hook_slow_kv_arrival_s: float = 0.0  # TEST HOOK: each prompt's received KV waits this long (a slow transfer)

    def __post_init__(self) -> None:
        if not self.min_step_interval_s >= 0:
            raise ValueError(f"min_step_interval_s must be >= 0 (got {self.min_step_interval_s})")
        if not 0 < self.gpu_share_while_prefilling <= 1:
            raise ValueError(f"gpu_share_while_prefilling must be in (0, 1] (got {self.gpu_share_while_prefilling})")
        check_transport_device(self.kv_transport, self.engine.device)  # before the model loads


class DecodeWorker:
    """The decode worker's gRPC side: the streams of the requests reserved here, over an engine side
    (engine_side.py) reached through `engine`, a link (pdserve/serving/engine_link.py): on a thread of this process,
    or in a process of its own."""

    def __init__(self, config: DecodeWorkerConfig, identity: WorkerIdentity, metrics: Metrics, engine):
        """Blocks until the engine side is built and warmed up (`decode_engine` makes `engine`)."""
        self.config, self.identity, self.metrics = config, identity, metrics
        self.engine = engine
        info: DecodeSideInfo = engine.wait_ready()  # model load and warm-up: ready means ready
        self.layout, self.kv_endpoint, self.skip_mtp_kv = info.layout, info.kv_endpoint, info.skip_mtp_kv
        self.model, self.warmup_report, self.last_load = info.model, info.warmup, info.load
        # Request id -> where its outputs go (a router's DecodeStream call); touched only on the event loop.
        self.streams = StreamHub(metrics, on_attached=self._attached, on_detached=self._detached)
        self.drain: Optional[Drain] = None  # attached requests count as work in flight for a graceful drain
        self.engine_gone: Optional[str] = None  # why, once the engine process has exited

    def start(self, loop: asyncio.AbstractEventLoop, on_engine_gone: Callable[[], None] = lambda: None) -> None:
        def gone(why: str) -> None:
            log.error("%s: failing the requests on this worker and stopping it", why)
            self.engine_gone = why
            self.streams.fail_all(ServiceError(grpc.StatusCode.UNAVAILABLE, "the decode worker's engine exited"))
            on_engine_gone()

        self.engine.start(loop, self.streams.deliver, self.streams.fail_all, gone)

    def abort(self, request_id: str) -> None:
        """Drop a request on the engine side (its pages go, its gauges follow)."""
        self.engine.tell("drop", request_id)

    def _attached(self, request_id: str) -> None:
        if self.drain is not None:
            self.drain.in_flight += 1

    def _detached(self, request_id: str, finished: bool) -> None:
        if self.drain is not None:
            self.drain.in_flight -= 1
        if not finished:  # its call went away or the router cancelled it: free the pages now
            self.metrics.count(self.metrics.requests, outcome="aborted")
            self.abort(request_id)

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(worker_id=self.identity.worker_id, role=pb.WORKER_ROLE_DECODE,
                             address=self.identity.address, layout=layout_to_proto(self.layout),
                             model=gen_pb.ModelInfo(**self.model), kv_endpoint=self.kv_endpoint)


def decode_engine(config: DecodeWorkerConfig, metrics: Metrics, in_process: bool, setup=None):
    """The link to a decode worker's engine side: in an engine process of its own (`in_process`; `setup()` runs
    there first), or on a thread of this one."""
    if in_process:
        return EngineProcess(functools.partial(build_in_engine_process, config), "decode-engine", metrics, setup)
    return EngineOnThread(DecodeEngineSide(config, metrics))


class DecodeServicer(WorkerControl, pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.w = worker

    def engine_abort(self, request_id: str) -> asyncio.Future:
        return self.w.engine.call("abort", request_id)

    def engine_load(self) -> asyncio.Future:
        return self.w.engine.call("load")

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        w = self.w
        try:
            if not request.input_ids:
                raise invalid("input_ids: the prompt is empty")
            if request.request_id in w.streams:  # its previous stream is still being read
                raise ValueError(f"request_id {request.request_id!r} is already in use on this decode worker")
            params = sampling_from_proto(request.sampling_params)
            ids = list(request.input_ids)
            rid = request.request_id
            mark("decode.reserve", rid)
            try:
                t = await w.engine.call("reserve", rid, ids, params)
            except asyncio.CancelledError:  # the call ended: the reservation, made or not, goes after it
                w.abort(rid)
                raise
        except (ServiceError, ValueError) as e:
            w.metrics.count(w.metrics.requests, outcome="rejected")
            await abort_with(context, e)
        # Registered before any output can exist: outputs are produced only after the KV arrives.
        stream = w.streams.open(rid)
        asyncio.get_running_loop().call_later(RESERVATION_ATTACH_S, self._release_unattached, stream)
        return pb.ReserveResponse(room=t.room, kv_endpoint=w.kv_endpoint, dst_pages=t.pages,
                                  layout=layout_to_proto(w.layout), skip_mtp_kv=w.skip_mtp_kv)

    async def DecodeStream(self, request_iterator, context: grpc.aio.ServicerContext):
        """Reads attach/cancel messages while it writes, per batch of engine steps, one message with every new
        token of the requests attached to this call."""
        hub = self.w.streams
        conn = Connection()
        reader = asyncio.ensure_future(self._read_commands(request_iterator, conn))
        try:
            while not conn.done:
                items = await conn.next_batch()
                if items:
                    msg = hub.message(items)
                    if msg.updates:
                        yield msg
        finally:
            reader.cancel()
            hub.close(conn)

    async def _read_commands(self, request_iterator, conn: Connection) -> None:
        hub = self.w.streams
        try:
            async for command in request_iterator:
                for request_id in command.attach:
                    hub.attach(conn, request_id)
                for request_id in command.cancel:
                    hub.cancel(conn, request_id)
        finally:  # the router ended its side (or the call is gone): end once the attached requests have
            conn.closing = True
            conn.wake()

    def _release_unattached(self, stream) -> None:
        w = self.w
        if stream.conn is not None or w.streams.get(stream.request_id) is not stream:
            return
        w.streams.drop(stream.request_id, finished=True)
        log.info("request %s: no DecodeStream call attached it within %g s of its reservation; releasing it",
                 stream.request_id, RESERVATION_ATTACH_S)
        w.metrics.count(w.metrics.requests, outcome="aborted")
        w.abort(stream.request_id)


async def serve_decode(worker: DecodeWorker, ready=None) -> None:
    """Run the worker (built and warmed up: ready means ready) until SIGTERM/SIGINT, or until its engine process
    exits, then drain: no new reservations, streams in flight finish."""
    sec = worker.config.security
    # Work in flight for the drain: Reserve calls, and each request attached to a DecodeStream call.
    worker.drain = Drain(tracked={"Reserve"}, refused={"Reserve", "GetLoad"})
    server, port = create_server(worker.config.host, worker.config.port,
                                 [pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name],
                                 lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker), s),
                                 interceptors=internal_auth(sec), drain=worker.drain,
                                 credentials=sec.server_credentials())
    stop = stop_on_signals()
    worker.start(asyncio.get_running_loop(), on_engine_gone=stop.set)
    await start_serving(server)
    if ready is not None:
        ready(port)
    await serve_until_signal(server, worker.config.drain_timeout_s, worker.engine.stop, stop=stop)
