"""The decode worker process: the gRPC DecodeWorker service (Reserve, DecodeStream) over a DecodeWorker, whose
DecodeEngine runs on its own thread (EngineLoop) beside the KV receiver prefill workers stream into.

    DecodeServicer -> DecodeWorker (EngineLoop) -> DecodeEngine (StepHooks) -> LLMEngine

The servicer converts messages and maps errors; the worker hands commands to the engine thread and the engine's
outputs to the event loop (StreamHub, streams.py); the engine owns each request's phase (engine.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional

import grpc

from pdserve.common.trace import mark
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_transfer import ERROR_KINDS, KVTransferError, RequestReceiver, TRANSPORTS, check_transport_device
from pdserve.serving.auth import SecurityConfig, internal_auth
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.grpc_shell import (
    Drain, ServiceError, abort_with, create_server, invalid, serve_until_signal, start_serving,
)
from pdserve.serving.metrics import Metrics, SpecMetrics
from pdserve.serving.nixl_flags import check_nixl_backend, nixl_options
from pdserve.serving.rpc_convert import layout_to_proto, sampling_from_proto
from pdserve.serving.warmup import WarmupReport, warm_up_worker
from pdserve.serving.worker_common import (
    WorkerControl, WorkerIdentity, kv_layout, model_info, on_engine_thread, start_metrics,
)
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from .engine import DecodeEngine, DecodeRequest, Items, Phase
from .pacing import DecodePacing
from .streams import Connection, StreamHub

log = logging.getLogger(__name__)
# A reservation that no DecodeStream call has attached this long after Reserve answered (or by the request's
# deadline, if sooner) is released: the router attaches right after the answer, so its absence means the request
# ended (deadline, cancel, router gone). NOTE: not shorter than a busy router's event loop may take to send the
# attach; a router whose attach still comes too late gets NOT_FOUND and retries the request on another worker.
RESERVATION_ATTACH_S = 5.0
# The requests_total outcome of each way a request ends.
OUTCOMES = {Phase.DONE: "finished", Phase.CANCELLED: "aborted", Phase.FAILED: "failed"}


@dataclass(frozen=True)
class DecodeWorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_transport: str = "tcp"
    nixl_backend: Optional[str] = None  # --kv-transport nixl: NIXL's backend plugin (None: UCX)
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

    def __post_init__(self) -> None:
        check_nixl_backend(self.kv_transport, self.nixl_backend)
        if not self.min_step_interval_s >= 0:
            raise ValueError(f"min_step_interval_s must be >= 0 (got {self.min_step_interval_s})")
        if not 0 < self.gpu_share_while_prefilling <= 1:
            raise ValueError(f"gpu_share_while_prefilling must be in (0, 1] (got {self.gpu_share_while_prefilling})")
        check_transport_device(self.kv_transport, self.engine.device)  # before the model loads


class DecodeWorker:
    """The engine (a DecodeEngine over an LLMEngine, on the EngineLoop's thread), the KV receiver, pacing, and the
    streams of the requests reserved here (StreamHub, on the event loop)."""

    def __init__(self, config: DecodeWorkerConfig, identity: WorkerIdentity, metrics: Metrics,
                 core: Optional[LLMEngine] = None):
        self.config, self.identity, self.metrics = config, identity, metrics
        self.core = core or LLMEngine(config.engine)
        start_metrics(metrics, self.core, config.kv_transport, TRANSPORTS, ERROR_KINDS)
        self.core.spec_observer = SpecMetrics(metrics)  # pdserve_spec_* histograms (recorded only when speculating)
        self.warmup_report: Optional[WarmupReport] = None
        self.layout = kv_layout(self.core, self.core.model.has_mtp_weights)
        # Without speculation nothing reads the NextN/MTP layer's KV: requests ask the prefill worker for the main
        # model's layers only (ReserveResponse.skip_mtp_kv), sparing it a whole layer's prompt pass.
        self.skip_mtp_kv = self.core.model.has_mtp_weights and self.core.speculator is None
        # Receiver callbacks run on its threads: they only queue work for the engine thread.
        self.receiver = RequestReceiver(
            TRANSPORTS.get(config.kv_transport).receiver, self.layout, host=config.kv_host, port=config.kv_port,
            on_layer=lambda rid, layer, slots, values: self.loop.submit(
                lambda: self.engine.kv_layer(rid, layer, slots, values)),
            on_done=self._kv_arrived,
            on_failed=lambda rid, err: self.loop.submit(lambda: self.engine.kv_failed(rid, err)),
            timeout_s=config.transfer_timeout_s, token=config.security.internal_token,
            max_room_tokens=self.core.pool.allocator.num_pages * self.core.pool.page_size,
            kv_buffer=self.core.pool.kv,  # nccl/gloo/cuda_ipc write straight into the pool's pages; tcp too
            **nixl_options(config.nixl_backend))
        self.kv_endpoint = self.receiver.endpoint
        layers = self.core.model_config.num_hidden_layers if self.skip_mtp_kv else self.layout.num_kv_layers
        self.engine = DecodeEngine(self.core, self.receiver, layers, deliver=self._deliver, on_end=self._ended,
                                   max_queued=config.max_queued_requests)
        self.pacing = DecodePacing(self.core, config.min_step_interval_s, config.gpu_share_while_prefilling, metrics)
        self.loop = EngineLoop(self._step, lambda: self.engine.has_work, name="decode-engine",
                               on_error=self._step_failed, hold=self._hold if self.pacing.active else None,
                               idle=self.engine.send_unsent, fatal=self.core.cannot_go_on)
        # Request id -> where its outputs go (a router's DecodeStream call); touched only on the event loop.
        self.streams = StreamHub(metrics, on_attached=self._attached, on_detached=self._detached)
        self.drain: Optional[Drain] = None  # attached requests count as work in flight for a graceful drain
        self._aio_loop: Optional[asyncio.AbstractEventLoop] = None
        self.last_load = self.load()  # read here, before the engine thread starts

    def warm_up(self) -> None:
        """Before the port opens (pdserve/serving/warmup.py), unless the config skips it: ready means ready."""
        if self.config.warmup:
            self.warmup_report = warm_up_worker(self.core, "decode")
            self.last_load = self.load()

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio_loop = aio_loop
        self.loop.start()

    async def stop(self) -> None:
        self.loop.stop()
        self.receiver.close()

    # ---- engine thread -------------------------------------------------------------------------------------------------
    def _kv_arrived(self, request_id: str, aux: dict) -> None:
        """The receiver's thread: a prompt's KV and aux record are in; the engine thread admits the request."""
        mark("decode.kv_arrived", request_id)
        self.loop.submit(lambda: self.engine.kv_done(request_id, aux))

    def _hold(self) -> float:
        """Seconds the next step waits (pacing.py): only while prompts are being prefilled for this worker; with
        none on its way the steps run back to back."""
        if not self.engine.awaiting_kv:
            return 0.0
        wait = self.pacing.hold(time.monotonic())
        if wait > 0:
            self.engine.send_unsent()  # no round runs meanwhile to send them from
        return wait

    def _step(self) -> None:
        self.pacing.step_started(time.monotonic())
        rows = len(self.core.scheduler.running)
        self.engine.step()
        self.pacing.step_launched(rows, self.engine.awaiting_kv)
        self._update_gauges()

    def _step_failed(self, error: BaseException) -> None:
        # NOTE: the exception's text stays in the log (EngineLoop logged the traceback), never in a response.
        self.engine.fail_all(ServiceError(grpc.StatusCode.INTERNAL,
                                          "decode step failed (the decode worker's log has the details)"))
        self._update_gauges()

    def drop(self, request_id: str) -> None:
        """The request goes; the gauges follow at once (an idle engine runs no step that would refresh them)."""
        self.engine.abort(request_id)
        self._update_gauges()

    def load(self) -> pb.WorkerLoad:
        sched = self.core.scheduler
        allocators = [c.allocator for c in sched.caches]  # every DP rank's pool (one without DP attention)
        return pb.WorkerLoad(num_running_requests=len(sched.running), num_waiting_requests=len(sched.waiting),
                             num_free_pages=sum(a.num_free for a in allocators),
                             num_total_pages=sum(a.num_pages for a in allocators),
                             num_transferring=self.engine.num_transferring)

    def _update_gauges(self) -> None:
        sched = self.core.scheduler
        self.metrics.running.set(len(sched.running))
        self.metrics.queue_length.set(self.engine.num_transferring)
        total = sum(c.allocator.num_pages for c in sched.caches)
        self.metrics.kv_pool_usage.set(self.core.kv_pages_in_use_by_requests() / total)

    def _deliver(self, items: Items) -> None:
        """A step's outputs (and failures) to the event loop, in one hand-off."""
        self._aio_loop.call_soon_threadsafe(self.streams.deliver, items)

    def _ended(self, r: DecodeRequest) -> None:
        m = self.metrics
        m.count(m.requests, outcome=OUTCOMES[r.phase])
        if r.phase is Phase.DONE:
            m.e2e.observe(time.monotonic() - r.arrival_time)
        elif isinstance(r.error, KVTransferError):
            transport = getattr(r.error, "transport", None) or self.config.kv_transport  # the pairing's, if known
            m.count(m.transfer_failures, kind=r.error.kind, transport=transport)

    # ---- event loop ------------------------------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Drop a request on the engine thread (its pages go, its gauges follow)."""
        self.loop.submit(lambda: self.drop(request_id))

    def _attached(self, request_id: str) -> None:
        if self.drain is not None:
            self.drain.in_flight += 1

    def _detached(self, request_id: str, finished: bool) -> None:
        if self.drain is not None:
            self.drain.in_flight -= 1
        if not finished:  # its call went away or the router cancelled it: free the pages now
            self.abort(request_id)

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(worker_id=self.identity.worker_id, role=pb.WORKER_ROLE_DECODE,
                             address=self.identity.address, layout=layout_to_proto(self.layout),
                             model=gen_pb.ModelInfo(**model_info(self.core)), kv_endpoint=self.kv_endpoint)


class DecodeServicer(WorkerControl, pb_grpc.DecodeWorkerServicer):
    """Thin: converts messages, hands work to the engine thread, maps errors to status codes."""

    def __init__(self, worker: DecodeWorker):
        self.w = worker

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
            # (A call that ends meanwhile has its reservation, made or not, dropped after it.)
            r = await on_engine_thread(w.loop, lambda: w.engine.reserve(rid, ids, params), lambda: w.drop(rid))
        except (ServiceError, ValueError) as e:
            w.metrics.count(w.metrics.requests, outcome="rejected")
            await abort_with(context, e)
        # Registered before any output can exist: outputs are produced only after the KV arrives.
        stream = w.streams.open(rid)
        left = context.time_remaining()  # (None: the request has no deadline)
        release_in = RESERVATION_ATTACH_S if left is None else min(RESERVATION_ATTACH_S, left)
        asyncio.get_running_loop().call_later(release_in, self._release_unattached, stream)
        return pb.ReserveResponse(room=r.room, kv_endpoint=w.kv_endpoint, dst_pages=r.pages,
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
        log.info("request %s: no DecodeStream call attached it within %g s of its reservation, or by its deadline; "
                 "releasing it", stream.request_id, RESERVATION_ATTACH_S)
        w.abort(stream.request_id)


async def serve_decode(worker: DecodeWorker, ready=None) -> None:
    """Warm up, then run the worker's gRPC server until SIGTERM/SIGINT, then drain: no new reservations, streams in
    flight finish (see grpc_shell.serve_until_signal). The port opens only after the warm-up: ready means ready."""
    worker.warm_up()
    sec = worker.config.security
    # Work in flight for the drain: Reserve calls, and each request attached to a DecodeStream call.
    worker.drain = Drain(tracked={"Reserve"}, refused={"Reserve", "GetLoad"})
    server, port = create_server(worker.config.host, worker.config.port,
                                 [pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name],
                                 lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker), s),
                                 interceptors=internal_auth(sec), drain=worker.drain,
                                 credentials=sec.server_credentials())
    worker.start(asyncio.get_running_loop())
    await start_serving(server)
    if ready is not None:
        ready(port)
    await serve_until_signal(server, worker.config.drain_timeout_s, worker.stop)
