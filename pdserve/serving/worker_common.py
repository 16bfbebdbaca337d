"""What the prefill and decode workers share: identity, KV layout fingerprint, model info, commands run on the engine
thread for an RPC, and the RPCs both services answer alike."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.engine import LLMEngine
from pdserve.common.values import KVLayout
from pdserve.serving.metrics import Metrics
from pdserve.weights import single_process_shapes


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    role: str  # "prefill" | "decode"
    address: str  # host:port of the gRPC server, as peers should dial it


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def model_fingerprint(engine: LLMEngine) -> str:
    """Equal for two workers that run the same checkpoint: config.json plus every parameter's name, shape, dtype
    (and the random seed for dummy weights). Shapes as one process holds them: a tensor-parallel worker runs the
    same model as a single-process one, and their KV is alike."""
    h = hashlib.sha256()
    h.update(json.dumps(engine.model_config.extra, sort_keys=True, default=str).encode())
    h.update(engine.config.load_format.encode())
    for name, shape, dtype in single_process_shapes(engine.model):
        h.update(f"{name}:{shape}:{dtype}".encode())
    return h.hexdigest()[:32]


def kv_layout(engine: LLMEngine, ships_mtp: bool) -> KVLayout:
    cfg = engine.model_config
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if ships_mtp else 0)
    return KVLayout(model_fingerprint=model_fingerprint(engine), page_size=engine.pool.page_size,
                    num_kv_layers=layers, kv_dim=cfg.kv_cache_dim, dtype=str(engine.pool.kv.dtype).replace("torch.", ""))


def start_metrics(metrics: Metrics, engine: LLMEngine, kv_transport: str, transports, error_kinds) -> None:
    """A worker's metrics labelled with its model's name, and its transfer series at 0 for every failure kind
    (`error_kinds`) and every transport its pairs may report: its --kv-transport, or with auto also each transport
    of `transports` (the KV transport registry) that moves KV on its device."""
    metrics.name_model(engine.model_config.name)
    device = engine.pool.kv.device.type
    labels = {kv_transport} if kv_transport != "auto" else {
        "auto", *(n for n in transports.names() if n != "auto" and device in transports.get(n).devices)}
    metrics.start_transfers_at_zero(error_kinds, labels)


def model_info(engine: LLMEngine) -> dict[str, Any]:
    cfg = engine.model_config
    return {"model_name": cfg.name, "vocab_size": cfg.vocab_size,
            "max_context_length": engine.scheduler.config.max_model_len,
            "eos_token_ids": sorted(engine.eos_token_ids), "model_type": cfg.model_type}


async def on_engine_thread(loop, command: Callable[[], Any], undo: Callable[[], Any]) -> Any:
    """`command()` run on the engine thread (`loop`: the worker's EngineLoop), awaited by an RPC. If the RPC ends
    meanwhile (its deadline, a cancel), the command may run all the same (it may be running already), so `undo()` is
    queued behind it: the engine thread runs its commands in order, so undo finds what the command made, or nothing.
    Without it a reservation or a computed prompt nobody waits for any more would hold its pages for good."""
    try:
        return await asyncio.wrap_future(loop.submit(command))
    except asyncio.CancelledError:
        loop.submit(undo)
        raise


LOAD_WAIT_S = 0.05  # GetLoad waits this long for the engine thread, then answers the last load it read


class WorkerControl:
    """The RPCs both worker services share (Abort, GetLoad, GetWorkerInfo), over `self.w`: a worker whose engine
    thread runs `engine_abort` and `engine_load` (by default through its EngineLoop `loop`: an engine with
    abort(request_id), and the worker's load()), and with info()."""

    def engine_abort(self, request_id: str) -> "asyncio.Future":
        return asyncio.wrap_future(self.w.loop.submit(lambda: self.w.engine.abort(request_id)))

    def engine_load(self) -> "asyncio.Future":
        return asyncio.wrap_future(self.w.loop.submit(self.w.load))

    async def Abort(self, request, context):
        from pdserve.v1 import worker_pb2 as pb

        found = await self.engine_abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def GetLoad(self, request, context):
        # NOTE: the router's heartbeat. It drops a worker whose GetLoad times out, so the answer must not wait
        # behind a long engine step (a kernel compile, a long prompt): the engine thread reads the load between two
        # steps, and if it does not within LOAD_WAIT_S, the last load it read answers.
        fresh = self.engine_load()
        try:
            self.w.last_load = await asyncio.wait_for(asyncio.shield(fresh), LOAD_WAIT_S)
        except asyncio.TimeoutError:
            pass
        return self.w.last_load

    async def GetWorkerInfo(self, request, context):
        return self.w.info()
