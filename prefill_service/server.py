"""The prefill worker process: gRPC PrefillWorker service over a PrefillEngine running on its own thread."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Optional

import grpc

from pdserve.common.trace import mark
from pdserve.serving.auth import SecurityConfig, internal_auth
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.grpc_shell import (
    Drain, ServiceError, create_server, invalid, serve_until_signal, start_serving, status_of,
)
from pdserve.kv_transfer import ERROR_KINDS, KVTransferError, SendHandle, TRANSPORTS, check_transport_device
from pdserve.serving.metrics import Metrics
from pdserve.serving.rpc_convert import (
    layout_from_proto, layout_to_proto, logprob_to_proto, logprobs_to_proto, sampling_from_proto,
)
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.serving.warmup import WarmupReport, warm_up_worker
from pdserve.serving.nixl_flags import check_nixl_backend, nixl_options
from pdserve.serving.worker_common import (
    WorkerControl, WorkerIdentity, kv_layout, model_info, on_engine_thread, start_metrics,
)

from .engine import MTP_KV_NOT_COMPUTED, PrefillEngine, PrefillJob, PrefillResult
from .prompt_calls import PromptCall

log = logging.getLogger(__name__)

# How often a stop asks whether the transfers in flight have ended.
TRANSFERS_DONE_POLL_S = 0.05

# KVTransferError kinds -> the status the router sees.
TRANSFER_STATUS = {"incompatible": grpc.StatusCode.FAILED_PRECONDITION,
                   "unauthenticated": grpc.StatusCode.FAILED_PRECONDITION, "unreachable": grpc.StatusCode.UNAVAILABLE,
                   "timeout": grpc.StatusCode.DEADLINE_EXCEEDED, "aborted": grpc.StatusCode.CANCELLED,
                   "peer_failed": grpc.StatusCode.UNAVAILABLE, "protocol": grpc.StatusCode.INTERNAL}


@dataclass(frozen=True)
class PrefillWorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    kv_transport: str = "tcp"
    nixl_backend: Optional[str] = None  # --kv-transport nixl: NIXL's backend plugin (None: UCX)
    # True: each layer's KV is sent as soon as its forward wrote it (overlapping the rest of the prefill);
    # False: all layers after the whole forward (--no-kv-layerwise, to measure what streaming saves in TTFT).
    kv_layerwise: bool = True
    transfer_timeout_s: float = 300.0
    worker_id: Optional[str] = None
    max_queued_requests: int = 256  # prompts waiting for compute; beyond: RESOURCE_EXHAUSTED at once
    drain_timeout_s: float = 30.0  # on SIGTERM, how long requests in flight may take to finish
    security: SecurityConfig = SecurityConfig()
    warmup: bool = True  # run the warm-up (pdserve/serving/warmup.py) before the port opens

    def __post_init__(self) -> None:
        check_transport_device(self.kv_transport, self.engine.device)  # before the model loads
        check_nixl_backend(self.kv_transport, self.nixl_backend)


class PrefillWorker:
    def __init__(self, config: PrefillWorkerConfig, identity: WorkerIdentity, metrics: Metrics,
                 core: Optional[LLMEngine] = None):
        self.config, self.identity, self.metrics = config, identity, metrics
        self.core = core or LLMEngine(config.engine)
        start_metrics(metrics, self.core, config.kv_transport, TRANSPORTS, ERROR_KINDS)
        self.warmup_report: Optional[WarmupReport] = None
        self._evicted: list[bytes] = []  # piggybacked on responses for a router without Redis
        self.core.prefix_cache.on_evict = self._evicted.extend
        self.publishers: list = []  # ownership stores told about held/evicted blocks (Redis), set by the CLI
        ships_mtp = self.core.model.has_mtp_weights
        self.layout = kv_layout(self.core, ships_mtp)
        sender_cls = TRANSPORTS.get(config.kv_transport).sender
        self.sender = sender_cls(self.layout, timeout_s=config.transfer_timeout_s,
                                 token=config.security.internal_token, device=self.core.pool.kv.device,
                                 **nixl_options(config.nixl_backend))
        self.engine = PrefillEngine(self.core, self.sender, on_blocks=self._held,
                                    max_queued=config.max_queued_requests, layerwise=config.kv_layerwise,
                                    on_first_tokens=self._deliver)
        self.loop = EngineLoop(self._step, lambda: self.engine.has_work, name="prefill-engine",
                               on_error=self._step_failed, idle=self._poll_transfers, fatal=self.core.cannot_go_on)
        self.event_loop: Optional[asyncio.AbstractEventLoop] = None  # where the prompts await their answers
        self.last_load = self.load()  # read here, before the engine thread starts

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.event_loop = loop
        self.loop.start()

    def _held(self, hashes: list[bytes]) -> None:
        for store in self.publishers:
            store.record(self.identity.worker_id, hashes)

    def _step(self) -> None:
        self._deliver(self.engine.step())
        self._poll_transfers()
        self._update_gauges()

    def take_binds(self) -> None:
        """Engine thread: destinations that came while the engine had nothing to compute (COMPUTED prompts)."""
        self._deliver(self.engine.take_binds())

    def _deliver(self, results: list[PrefillResult]) -> None:
        """Engine thread: the answers to the prompts awaiting them (PrefillJob.answer), in one hand-off to the
        event loop (one wake-up for the step's prompts)."""
        answers = []
        for r in results:
            self.metrics.ttft.observe(r.ttft_s)
            answers.append((self.engine.records[r.request_id].job.answer, r))
        if answers:
            self.event_loop.call_soon_threadsafe(_settle, answers)

    def _update_gauges(self) -> None:
        sched, alloc = self.core.scheduler, self.core.pool.allocator
        self.metrics.queue_length.set(len(sched.waiting))
        self.metrics.running.set(len(sched.running))
        self.metrics.kv_pool_usage.set(self.core.kv_pages_in_use_by_requests() / alloc.num_pages)

    def _step_failed(self, error: BaseException) -> None:
        # NOTE: the exception's text stays in the log (EngineLoop logged the traceback), never in a response.
        failure = ServiceError(grpc.StatusCode.INTERNAL,
                               "prefill step failed (the prefill worker's log has the details)")
        answers = [(rec.job.answer, failure) for rec in self.engine.records.values()]
        self.event_loop.call_soon_threadsafe(_settle, answers)

    def _poll_transfers(self) -> None:
        """Engine thread, after each step and while idle: counts the transfers that ended (their prompts were
        answered already: the decode worker's stream tells the router how a transfer ended)."""
        self.engine.poll_transfers(self._count_transfer)

    def _count_transfer(self, rec, outcome) -> None:
        m, transport = self.metrics, rec.handle.transport
        if isinstance(outcome, KVTransferError):
            log.warning("request %s: KV transfer failed after the first token: %s", rec.request_id, outcome)
            m.count(m.transfer_failures, kind=outcome.kind, transport=transport)
            m.count(m.requests, outcome="failed")
            return
        mark("prefill.transfer_confirmed", rec.request_id)
        m.count(m.transfer_bytes, outcome.bytes_sent, transport=transport)
        m.observe(m.transfer_seconds, outcome.seconds, transport=transport)
        if rec.handle.link is not None:
            m.note_link(transport, rec.handle.link)
        m.count(m.requests, outcome="finished")

    async def transfers_done(self, timeout_s: float) -> None:
        """Waits (at most timeout_s) for the transfers still in flight, so that a stop does not cut them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not await asyncio.wrap_future(self.loop.submit(lambda: self.engine.num_sending)):
                return
            await asyncio.sleep(TRANSFERS_DONE_POLL_S)

    def drain_evicted(self) -> list[bytes]:
        out, self._evicted[:] = list(self._evicted), []
        for store in self.publishers:
            store.remove(self.identity.worker_id, out)
        return out

    def load(self) -> pb.WorkerLoad:
        sched, alloc = self.core.scheduler, self.core.pool.allocator
        free = alloc.num_free + self.core.prefix_cache.num_cache_only_pages
        return pb.WorkerLoad(num_running_requests=len(sched.running), num_waiting_requests=len(sched.waiting),
                             num_free_pages=free, num_total_pages=alloc.num_pages,
                             num_transferring=self.engine.num_sending)

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(worker_id=self.identity.worker_id, role=pb.WORKER_ROLE_PREFILL,
                             address=self.identity.address, layout=layout_to_proto(self.layout),
                             model=gen_pb.ModelInfo(**model_info(self.core)), block_size=self.layout.page_size)


class PrefillServicer(WorkerControl, pb_grpc.PrefillWorkerServicer):
    """Thin: converts messages, hands work to the engine thread, maps errors to status codes."""

    def __init__(self, worker: PrefillWorker, drain: Optional[Drain] = None):
        self.w = worker
        self.drain = drain or Drain()  # the server's: a draining worker refuses new prompts on open calls too

    async def PrefillStream(self, request_iterator, context: grpc.aio.ServicerContext):
        call = PromptCall(self.prefill, self.drain)
        async for msg in call.serve(request_iterator):
            yield msg

    async def prefill(self, request: pb.PrefillRequest,
                      destination: Awaitable[pb.ReserveResponse]) -> pb.PrefillResponse:
        """One prompt of a PrefillStream call, computed at once; its KV goes where `destination` (its bind) says once
        that comes. Its answer once the first token is sampled (the KV still on its way), or a ServiceError with the
        status to end it with."""
        w = self.w
        rid = request.request_id
        mark("prefill.recv", rid)
        w.metrics.count(w.metrics.prompts_received, rpc="PrefillStream")
        transport = w.config.kv_transport  # until the pairing says which (auto)
        try:
            if not request.input_ids:
                raise invalid("input_ids: the prompt is empty")
            params = sampling_from_proto(request.sampling_params)
            job = PrefillJob(rid, list(request.input_ids), params, answer=asyncio.get_running_loop().create_future())
            await on_engine_thread(w.loop, lambda: w.engine.add(job), lambda: self._give_up(rid))
            w.metrics.count(w.metrics.prompt_tokens, len(job.prompt_ids))
            try:
                handle, ships_mtp = await self._open(job, await self._destination(rid, destination))
                transport = handle.transport
                w.engine.bind(rid, handle, ships_mtp)
                w.loop.submit(w.take_binds)  # (an engine with nothing to compute is waiting for a command)
                result = await job.answer
            except BaseException:  # the router gave up (client cancelled), or no usable destination: stop the work
                job.answer.cancel()
                w.loop.submit(lambda: (w.engine.abort(rid), w._update_gauges()))  # idle: no step refreshes them
                raise
            w.metrics.count(w.metrics.prefix_hit_tokens, result.cached_tokens)
            # The answer goes at once, with the KV still on its way: the router sends the first token to its client
            # now rather than after the decode worker received it (its stream reports what becomes of the transfer).
            resp = pb.PrefillResponse(first_token_id=result.first_token_id, cached_tokens=result.cached_tokens,
                                      evicted_block_hashes=w.drain_evicted(),
                                      prompt_logprobs=logprobs_to_proto((result.prompt_logprobs or [None])[1:]))
            if result.first_token_logprob is not None:
                resp.first_token_logprobs.CopyFrom(logprob_to_proto(result.first_token_logprob))
            mark("prefill.answer", rid)
            return resp
        except KVTransferError as e:
            w.metrics.count(w.metrics.transfer_failures, kind=e.kind, transport=transport)
            w.metrics.count(w.metrics.requests, outcome="failed")
            raise ServiceError(TRANSFER_STATUS.get(e.kind, grpc.StatusCode.INTERNAL), f"KV transfer failed: {e}"
                               ) from None
        except (ServiceError, ValueError) as e:
            w.metrics.count(w.metrics.requests, outcome="rejected")
            raise ServiceError(*status_of(e)) from None

    def _give_up(self, rid: str) -> None:
        """Engine thread: the job of a prompt cancelled while it was being added, whether or not it was (a prompt
        nobody binds would otherwise stay computed, its pages held for good)."""
        self.w.engine.abort(rid)
        self.w._update_gauges()  # an idle engine runs no step that would refresh them

    async def _destination(self, rid: str, destination: Awaitable[pb.ReserveResponse]) -> pb.ReserveResponse:
        timeout_s = self.w.config.transfer_timeout_s
        try:
            return await asyncio.wait_for(destination, timeout_s)
        except asyncio.TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no KV destination (bind) came for request {rid!r} within {timeout_s:g} s") from None

    async def _open(self, job: PrefillJob, destination: pb.ReserveResponse) -> tuple[SendHandle, bool]:
        """The send handle to `destination` (the decode worker's ReserveResponse: room, kv_endpoint, dst_pages,
        layout, skip_mtp_kv), after checking that it can take the job, and whether it wants the MTP layer's KV."""
        w = self.w
        mismatch = w.layout.mismatch(layout_from_proto(destination.layout))
        if mismatch:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this prefill worker cannot send KV to that decode worker: {mismatch}")
        dst_pages = list(destination.dst_pages)
        ships_mtp = w.core.model.has_mtp_weights and not destination.skip_mtp_kv
        try:
            w.engine.check_destination(job, dst_pages, ships_mtp)
        except ValueError as e:
            if str(e) == MTP_KV_NOT_COMPUTED:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, MTP_KV_NOT_COMPUTED) from None
            raise
        # Where this worker is paired with that decode worker already (every prompt after its first), opening a room
        # cannot block: open it right here. A bind arrives while the engine thread computes its prompt, and a thread
        # hop there (an executor thread, then back on this loop) is two more takers of the engine thread's GIL.
        room = (destination.kv_endpoint, destination.room, w.engine.num_layers_for(ships_mtp), dst_pages)
        handle = w.sender.begin_if_paired(*room)
        if handle is not None:
            return handle, ships_mtp
        opening = asyncio.ensure_future(asyncio.to_thread(w.sender.begin, *room))
        try:
            return await asyncio.shield(opening), ships_mtp
        except asyncio.CancelledError:  # the call ended while connecting: the handle it opens is nobody's
            opening.add_done_callback(_abort_opened)
            raise


def _settle(answers: list[tuple[asyncio.Future, object]]) -> None:
    """Event loop: each future its PrefillResult, or the exception to raise (a prompt that gave up meanwhile has
    its future cancelled)."""
    for future, outcome in answers:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _abort_opened(opening: asyncio.Future) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().abort()


async def serve_prefill(worker: PrefillWorker, ready=None) -> None:
    """Warm up, then run the worker's gRPC server until SIGTERM/SIGINT, then drain (see
    grpc_shell.serve_until_signal). The port opens only after the warm-up: ready means ready."""
    if worker.config.warmup:
        worker.warmup_report = warm_up_worker(worker.core, "prefill")
    sec = worker.config.security
    drain = Drain(refused={"PrefillStream", "GetLoad"})  # (PromptCall counts its prompts in flight)
    server, port = create_server(worker.config.host, worker.config.port,
                                 [pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name],
                                 lambda s: pb_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker, drain),
                                                                                       s),
                                 interceptors=internal_auth(sec), drain=drain, credentials=sec.server_credentials())
    worker.start(asyncio.get_running_loop())
    await start_serving(server)
    if ready is not None:
        ready(port)

    async def stop() -> None:
        await worker.transfers_done(worker.config.drain_timeout_s)
        worker.loop.stop()

    await serve_until_signal(server, worker.config.drain_timeout_s, stop)
