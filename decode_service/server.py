"""The decode worker process: gRPC DecodeWorker service over a DecodeEngine running on its own thread, plus the KV
receiver that prefill workers stream into."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import grpc

from pdserve.common.trace import mark
from pdserve.serving.auth import SecurityConfig, internal_auth
from pdserve.engine import EngineConfig, LLMEngine, RequestOutput, StepHooks
from pdserve.gpu_clock import ReplayClock
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.grpc_shell import (
    Drain, ServiceError, abort_with, create_server, invalid, serve_until_signal, start_serving,
)
from pdserve.kv_transfer import RequestReceiver, TRANSPORTS, check_transport_device
from pdserve.serving.metrics import Metrics
from pdserve.serving.rpc_convert import layout_to_proto, sampling_from_proto
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.serving.warmup import WarmupReport, slow_first_forward, warm_up_worker
from pdserve.serving.worker_common import WorkerControl, WorkerIdentity, kv_layout, model_info, on_engine_thread

from .engine import DecodeEngine
from .pacing import StepPacer
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
    def __init__(self, config: DecodeWorkerConfig, identity: WorkerIdentity, metrics: Metrics,
                 core: Optional[LLMEngine] = None):
        self.config, self.identity, self.metrics = config, identity, metrics
        self.core = core or LLMEngine(config.engine)
        if config.test_hook_slow_first_forward_s:
            slow_first_forward(self.core, config.test_hook_slow_first_forward_s)
        self.warmup_report: Optional[WarmupReport] = None
        self.layout = kv_layout(self.core, self.core.model.has_mtp_weights)  # the pool's: what pairing checks
        # Without speculation nothing reads the NextN/MTP layer's KV: requests ask the prefill worker for the main
        # model's layers only (ReserveResponse.skip_mtp_kv), sparing it a whole layer's prompt pass.
        self.skip_mtp_kv = self.core.model.has_mtp_weights and self.core.speculator is None
        # Request id -> where its outputs go (a router's DecodeStream call); touched only on the event loop.
        self.streams = StreamHub(metrics, on_attached=self._attached, on_detached=self._detached)
        self.drain: Optional[Drain] = None  # attached requests count as work in flight for a graceful drain
        self.aio_loop: Optional[asyncio.AbstractEventLoop] = None
        # Receiver callbacks run on its threads: they only queue work for the engine thread.
        self.receiver = RequestReceiver(
            TRANSPORTS.get(config.kv_transport).receiver, self.layout, host=config.kv_host, port=config.kv_port,
            on_layer=lambda rid, layer, slots, values: self.loop.submit(
                lambda: self.engine.kv_layer(rid, layer, slots, values)),
            on_done=self._kv_arrived,
            on_failed=lambda rid, err: self.loop.submit(lambda: self.engine.kv_failed(rid, err)),
            timeout_s=config.transfer_timeout_s, token=config.security.internal_token,
            max_room_tokens=self.core.pool.allocator.num_pages * self.core.pool.page_size,
            kv_buffer=self.core.pool.kv)  # nccl/gloo/cuda_ipc write straight into the pool's pages; tcp too
        self.engine = DecodeEngine(self.core, self.receiver,
                                   self.core.model_config.num_hidden_layers if self.skip_mtp_kv
                                   else self.layout.num_kv_layers,
                                   on_output=self._output, on_failed=self._failed,
                                   max_queued=config.max_queued_requests)
        # A speculative round's outputs, held until the next round waits for the GPU (see _step).
        self._unsent: list[RequestOutput] = []
        if self.core.speculator is not None:
            self.core.hooks = _SendWhileWaiting(self)
        self.pacer = StepPacer(config.min_step_interval_s, config.gpu_share_while_prefilling)
        self.clock = self._replay_clock() if config.gpu_share_while_prefilling < 1 else None
        self._held_since: Optional[float] = None  # pacing: when the step to come was first held back
        self.loop = EngineLoop(self._step, lambda: self.engine.has_work, name="decode-engine",
                               on_error=self._step_failed, hold=self._hold if self._paces() else None,
                               idle=self.send_unsent)
        self.last_load = self.load()  # read here, before the engine thread starts

    def _paces(self) -> bool:
        """Whether a step can ever be held back: a fixed interval, or a share with graph replays to time (a CPU
        engine given a share, as `pdserve up` passes it everywhere, has none)."""
        return self.config.min_step_interval_s > 0 or self.clock is not None

    def _replay_clock(self) -> Optional[ReplayClock]:
        """Times this engine's CUDA graph replays (the GPU share's measure); None without graphs (a CPU engine, or
        graphs off): its steps then have no known GPU time and the share holds nothing back."""
        runners = [r for r in (self.core.runner.graphs, self.core.runner.mtp_graphs) if r is not None]
        if not runners:
            return None
        clock = ReplayClock()
        for runner in runners:
            runner.clock = clock
        return clock

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.aio_loop = loop
        self.loop.start()

    def _kv_arrived(self, request_id: str, aux: dict) -> None:
        """The receiver's thread: a prompt's KV and aux record are in; the engine thread admits the request."""
        mark("decode.kv_arrived", request_id)

        def admit() -> None:
            self.loop.submit(lambda: self.engine.kv_done(request_id, aux))

        delay = self.config.test_hook_slow_kv_arrival_s
        if delay:
            threading.Timer(delay, admit).start()
        else:
            admit()

    # ---- engine thread ------------------------------------------------------------------------------------------
    def _hold(self) -> float:
        """Seconds the next step waits (decode_service/pacing.py). Only while requests reserved here still wait for
        their KV, i.e. prompts are being prefilled for this worker; with none on its way the steps run back to
        back."""
        if not self.engine.pending:
            return 0.0
        now = time.monotonic()
        wait = self.pacer.wait(now)
        if wait > 0:
            self.send_unsent()  # no round runs meanwhile to send them from
            if self._held_since is None:
                self._held_since = now
        return wait

    def _step(self) -> None:
        now = time.monotonic()
        self.pacer.started(now)
        if self._held_since is not None:
            self.metrics.count(self.metrics.step_hold_seconds, now - self._held_since)
            self._held_since = None
        rows = len(self.core.scheduler.running)
        outputs = self.engine.step()
        if self.clock is not None:  # charged as the step it will be once the prompts on their way have joined
            self.pacer.launched(self.clock.take_launched(scale=(rows + len(self.engine.pending)) / max(rows, 1)))
            replays = self.clock.take_completed()
            self.pacer.replays_completed(replays)
            for seconds, fastest in replays:
                self.metrics.replay_stretch.observe(seconds / fastest)
        self.send_unsent()  # held from the round before, if this step had no device wait to send them from
        # One hand-off to the event loop per step, not one per request. With speculation the next round's one
        # device-to-host read is a wait with nothing else to do (no overlap scheduling there): handed off from it
        # (_SendWhileWaiting), the event loop's work for these tokens (their messages, the stream writes) runs while
        # the GPU verifies, and no longer holds the GIL between two rounds when the engine thread wants it back.
        if outputs and self.core.speculator is not None and self.engine.has_work:
            self._unsent = outputs
        elif outputs:
            self.aio_loop.call_soon_threadsafe(self._deliver_all, outputs)
        self._update_gauges()

    def send_unsent(self) -> None:
        """Engine thread: hand the held outputs to the event loop."""
        if self._unsent:
            outputs, self._unsent = self._unsent, []
            self.aio_loop.call_soon_threadsafe(self._deliver_all, outputs)

    def _update_gauges(self) -> None:
        sched, alloc = self.core.scheduler, self.core.pool.allocator
        self.metrics.running.set(len(sched.running))
        self.metrics.queue_length.set(self.engine.num_transferring)
        self.metrics.kv_pool_usage.set(self.core.kv_pages_in_use_by_requests() / alloc.num_pages)

    def abort(self, request_id: str) -> None:
        """Drop a request on the engine thread (`drop`)."""
        self.loop.submit(lambda: self.drop(request_id))

    def drop(self, request_id: str) -> None:
        """Engine thread: the request goes; the gauges follow at once (an idle engine runs no step that would
        refresh them)."""
        self.engine.abort(request_id)
        self._update_gauges()

    def _output(self, out: RequestOutput) -> None:
        mark("decode.first_output", out.request_id)  # (only a request's first token comes this way)
        self.aio_loop.call_soon_threadsafe(self._deliver, out.request_id, out)

    def _failed(self, request_id: str, error: Exception) -> None:
        kind = getattr(error, "kind", "protocol")
        transport = getattr(error, "transport", None) or self.config.kv_transport  # the pairing's, where known
        self.metrics.count(self.metrics.transfer_failures, kind=kind, transport=transport)
        self.aio_loop.call_soon_threadsafe(self._deliver, request_id, error)

    def _step_failed(self, error: BaseException) -> None:
        self.send_unsent()  # (tokens of the round before, emitted before the failure)
        err = ServiceError(grpc.StatusCode.INTERNAL, "decode step failed (the decode worker's log has the details)")
        self.aio_loop.call_soon_threadsafe(self.streams.fail_all, err)

    # ---- event loop -------------------------------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        self.streams.deliver([(request_id, item)])

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        self.streams.deliver([(out.request_id, out) for out in outputs])

    def _attached(self, request_id: str) -> None:
        if self.drain is not None:
            self.drain.in_flight += 1

    def _detached(self, request_id: str, finished: bool) -> None:
        if self.drain is not None:
            self.drain.in_flight -= 1
        if not finished:  # its call went away or the router cancelled it: free the pages now
            self.metrics.count(self.metrics.requests, outcome="aborted")
            self.abort(request_id)

    def load(self) -> pb.WorkerLoad:
        sched, alloc = self.core.scheduler, self.core.pool.allocator
        return pb.WorkerLoad(num_running_requests=len(sched.running), num_waiting_requests=len(sched.waiting),
                             num_free_pages=alloc.num_free, num_total_pages=alloc.num_pages,
                             num_transferring=self.engine.num_transferring)

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(worker_id=self.identity.worker_id, role=pb.WORKER_ROLE_DECODE,
                             address=self.identity.address, layout=layout_to_proto(self.layout),
                             model=gen_pb.ModelInfo(**model_info(self.core)), kv_endpoint=self.receiver.endpoint)


class _SendWhileWaiting(StepHooks):
    """The decode worker's step hooks under speculation: the last round's outputs go to the event loop while the
    next round waits for the GPU."""

    def __init__(self, worker: DecodeWorker):
        self.worker = worker

    def before_device_wait(self) -> None:
        self.worker.send_unsent()


class DecodeServicer(WorkerControl, pb_grpc.DecodeWorkerServicer):
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
            t = await on_engine_thread(w.loop, lambda: w.engine.reserve(rid, ids, params), lambda: w.drop(rid))
        except (ServiceError, ValueError) as e:
            w.metrics.count(w.metrics.requests, outcome="rejected")
            await abort_with(context, e)
        # Registered before any output can exist: outputs are produced only after the KV arrives.
        stream = w.streams.open(t.request_id)
        asyncio.get_running_loop().call_later(RESERVATION_ATTACH_S, self._release_unattached, stream)
        return pb.ReserveResponse(room=t.room, kv_endpoint=w.receiver.endpoint, dst_pages=t.pages,
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
    """Warm up, then run the worker until SIGTERM/SIGINT, then drain: no new reservations, streams in flight
    finish. The port opens only after the warm-up: ready means ready."""
    if worker.config.warmup:
        worker.warmup_report = warm_up_worker(worker.core, "decode")
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

    async def stop() -> None:
        worker.loop.stop()
        worker.receiver.close()

    await serve_until_signal(server, worker.config.drain_timeout_s, stop)
