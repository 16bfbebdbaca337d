"""The decode worker's engine side: the engine, its KV receiver, pacing, and the EngineLoop thread that runs them.

It lives in the worker's gRPC process (EngineOnThread) or in an engine process of its own (EngineProcess; see
pdserve/serving/engine_link.py). Either way the gRPC side reaches it only through its commands (`reserve`, `drop`,
`abort`, `load`), each run on the engine thread, and hears from it only through its outbox: `deliver(items)` with
each step's outputs, `fail_all(error)` when a step fails.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional

import grpc

from pdserve.common.trace import mark
from pdserve.common.values import KVLayout
from pdserve.engine import LLMEngine, RequestOutput, StepHooks
from pdserve.gpu_clock import ReplayClock
from pdserve.kv_transfer import RequestReceiver, TRANSPORTS
from pdserve.sampling import SamplingParams
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.grpc_shell import ServiceError
from pdserve.serving.metrics import SpecMetrics
from pdserve.serving.warmup import WarmupReport, slow_first_forward, warm_up_worker
from pdserve.serving.worker_common import kv_layout, model_info
from pdserve.v1 import worker_pb2 as pb

from .engine import DecodeEngine
from .pacing import StepPacer


@dataclass(frozen=True)
class Reserved:
    """A reservation, as Reserve answers it."""
    room: int
    pages: list[int]


@dataclass(frozen=True)
class DecodeSideInfo:
    """What the gRPC side needs to know of its engine side, read once it is ready."""
    layout: KVLayout  # the pool's: what pairing checks
    kv_endpoint: str
    model: dict  # model_info()
    skip_mtp_kv: bool
    warmup: Optional[WarmupReport]
    load: pb.WorkerLoad


class DecodeEngineSide:
    def __init__(self, config, metrics, core: Optional[LLMEngine] = None):
        """config: a DecodeWorkerConfig; metrics: the worker's Metrics, or a MetricsRecorder in an engine process.
        `outbox` is set by the link before the loop starts."""
        self.config, self.metrics = config, metrics
        self.outbox = None
        self.core = core or LLMEngine(config.engine)
        if config.test_hook_slow_first_forward_s:
            slow_first_forward(self.core, config.test_hook_slow_first_forward_s)
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
                               idle=self._idle)

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

    def warm_up(self) -> None:
        """Before the port opens (pdserve/serving/warmup.py), unless the config skips it: ready means ready."""
        if self.config.warmup:
            self.warmup_report = warm_up_worker(self.core, "decode")

    def describe(self) -> DecodeSideInfo:
        return DecodeSideInfo(self.layout, self.receiver.endpoint, model_info(self.core), self.skip_mtp_kv,
                              self.warmup_report, self.load())

    def close(self) -> None:
        self.receiver.close()

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

    # ---- commands (engine thread) -------------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Reserved:
        t = self.engine.reserve(request_id, prompt_ids, params)
        return Reserved(t.room, t.pages)

    def drop(self, request_id: str) -> None:
        """The request goes; the gauges follow at once (an idle engine runs no step that would refresh them)."""
        self.engine.abort(request_id)
        self._update_gauges()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def load(self) -> pb.WorkerLoad:
        sched, alloc = self.core.scheduler, self.core.pool.allocator
        return pb.WorkerLoad(num_running_requests=len(sched.running), num_waiting_requests=len(sched.waiting),
                             num_free_pages=alloc.num_free, num_total_pages=alloc.num_pages,
                             num_transferring=self.engine.num_transferring)

    # ---- the loop (engine thread) -------------------------------------------------------------------------------
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
        self._update_gauges()
        self.send_unsent()  # held from the round before, if this step had no device wait to send them from
        # One hand-off per step, not one per request. With speculation the next round's one device-to-host read is
        # a wait with nothing else to do (no overlap scheduling there): handed off from it (_SendWhileWaiting), the
        # work for these tokens (their messages, the stream writes; in one process with the gRPC side) runs while
        # the GPU verifies, not between two rounds.
        if outputs and self.core.speculator is not None and self.engine.has_work:
            self._unsent = outputs
        elif outputs:
            self.outbox.deliver([(out.request_id, out) for out in outputs])

    def send_unsent(self) -> None:
        """Hand the held outputs over."""
        if self._unsent:
            outputs, self._unsent = self._unsent, []
            self.outbox.deliver([(out.request_id, out) for out in outputs])

    def _idle(self) -> None:
        """The loop found no work: what was held goes now, and the metrics recorded since the last hand-off."""
        self.send_unsent()
        self.outbox.flush()

    def _update_gauges(self) -> None:
        sched, alloc = self.core.scheduler, self.core.pool.allocator
        self.metrics.running.set(len(sched.running))
        self.metrics.queue_length.set(self.engine.num_transferring)
        self.metrics.kv_pool_usage.set(self.core.kv_pages_in_use_by_requests() / alloc.num_pages)

    def _output(self, out: RequestOutput) -> None:
        mark("decode.first_output", out.request_id)  # (only a request's first token comes this way)
        self.outbox.deliver([(out.request_id, out)])

    def _failed(self, request_id: str, error: Exception) -> None:
        kind = getattr(error, "kind", "protocol")
        transport = getattr(error, "transport", None) or self.config.kv_transport  # the pairing's, where known
        self.metrics.count(self.metrics.transfer_failures, kind=kind, transport=transport)
        self.outbox.deliver([(request_id, error)])

    def _step_failed(self, error: BaseException) -> None:
        self.send_unsent()  # (tokens of the round before, emitted before the failure)
        self.outbox.fail_all(ServiceError(grpc.StatusCode.INTERNAL,
                                          "decode step failed (the decode worker's log has the details)"))


class _SendWhileWaiting(StepHooks):
    """The decode engine's step hooks under speculation: the last round's outputs go out while the next round waits
    for the GPU."""

    def __init__(self, side: DecodeEngineSide):
        self.side = side

    def before_device_wait(self) -> None:
        self.side.send_unsent()


def build_in_engine_process(config, metrics) -> DecodeEngineSide:
    """An engine process's side (EngineProcess's `build`): built, then warmed up (when the config says so)."""
    side = DecodeEngineSide(config, metrics)
    side.warm_up()
    return side
