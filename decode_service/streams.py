"""Where a decode worker's outputs go: one router's DecodeStream call carries the tokens of all the requests it
attached, one message per engine step.

A request's RequestStream opens at Reserve and buffers what the engine produces until a call attaches it (its first
token can be ready before the router's attach message arrives). Each engine step hands its outputs to the event
loop once (`StreamHub.deliver`); every call gets one batch of them, and its writer sends what queued up meanwhile as
one DecodeStreamResponse (a request appears once per message: the steps a slow reader missed are merged). Per token
and per request there is no gRPC message, no task and no future: at batch 32 those cost the engine's thread more
than a decode step on a GPU (they share one GIL).

What a request's stream holds is where its outputs go (the call, or the outputs kept until one attaches) and when
its last token was sent; the request's phase is the engine thread's (engine.py). Everything here runs on the event
loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import grpc

from pdserve.engine import RequestOutput
from pdserve.kv_transfer import KVTransferError
from pdserve.serving.grpc_shell import ServiceError, status_of
from pdserve.serving.metrics import Metrics
from pdserve.serving.rpc_convert import finish_to_proto, logprobs_to_proto, usage_to_proto
from pdserve.v1 import worker_pb2 as pb


class Connection:
    """One DecodeStream call: the requests it attached and the batches of their outputs still to be sent."""

    def __init__(self) -> None:
        self.batches: asyncio.Queue[list[tuple[str, object]]] = asyncio.Queue()
        self.request_ids: set[str] = set()
        self.closing = False  # the router ended its side: the call ends once its requests have

    @property
    def done(self) -> bool:
        return self.closing and not self.request_ids and self.batches.empty()

    async def next_batch(self) -> list[tuple[str, object]]:
        """Everything queued for this call: waits for the first batch, then takes the rest without waiting."""
        items = await self.batches.get()
        while not self.batches.empty():
            items += self.batches.get_nowait()
        return items

    def wake(self) -> None:
        self.batches.put_nowait([])


@dataclass
class RequestStream:
    request_id: str
    conn: Optional[Connection] = None
    early: list = field(default_factory=list)  # outputs produced before a call attached the request
    last_token_time: Optional[float] = None


class StreamHub:
    """The worker's RequestStreams by request id. on_attached / on_detached(request_id, finished) tell the worker
    (drain accounting, and aborting a request whose call went away before it finished)."""

    def __init__(self, metrics: Metrics, on_attached: Callable[[str], None],
                 on_detached: Callable[[str, bool], None]):
        self.metrics = metrics
        self.on_attached, self.on_detached = on_attached, on_detached
        self.streams: dict[str, RequestStream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.streams

    def get(self, request_id: str) -> Optional[RequestStream]:
        return self.streams.get(request_id)

    def open(self, request_id: str) -> RequestStream:
        stream = self.streams[request_id] = RequestStream(request_id)
        return stream

    def attach(self, conn: Connection, request_id: str) -> bool:
        """Route request_id's outputs to conn; a request that is not reserved here (or is attached already) gets a
        NOT_FOUND failure on conn instead."""
        stream = self.streams.get(request_id)
        if stream is None or stream.conn is not None:
            conn.batches.put_nowait([(request_id, NotAttached(
                f"request_id {request_id!r} is not reserved on this worker, or is attached already (a reservation "
                "is released when no DecodeStream call attaches it soon after Reserve)"))])
            return False
        stream.conn = conn
        conn.request_ids.add(request_id)
        self.on_attached(request_id)
        if stream.early:
            conn.batches.put_nowait([(request_id, item) for item in stream.early])
            stream.early = []
        return True

    def deliver(self, items: list[tuple[str, object]]) -> None:
        """(request id, RequestOutput or exception) pairs from one engine step: one batch per call."""
        by_conn: dict[int, tuple[Connection, list]] = {}
        for request_id, item in items:
            stream = self.streams.get(request_id)
            if stream is None:
                continue  # cancelled or released meanwhile
            if stream.conn is None:
                stream.early.append(item)
            else:
                by_conn.setdefault(id(stream.conn), (stream.conn, []))[1].append((request_id, item))
        for conn, batch in by_conn.values():
            conn.batches.put_nowait(batch)

    def drop(self, request_id: str, finished: bool) -> Optional[RequestStream]:
        """Forget a request: finished, failed (finished=True: the engine is done with it) or cancelled."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and stream.conn is not None:
            stream.conn.request_ids.discard(request_id)
            self.on_detached(request_id, finished)
        return stream

    def cancel(self, conn: Connection, request_id: str) -> None:
        """The router dropped a request it attached to conn."""
        stream = self.streams.get(request_id)
        if stream is not None and stream.conn is conn:
            self.drop(request_id, finished=False)

    def close(self, conn: Connection) -> None:
        """The call ended: every request still on it is cancelled."""
        for request_id in list(conn.request_ids):
            self.drop(request_id, finished=False)

    # ---- one message per batch ---------------------------------------------------------------------------------
    def message(self, items: list[tuple[str, object]]) -> pb.DecodeStreamResponse:
        """The DecodeStreamResponse for a batch: one update per request, its outputs merged; a request that
        finished or failed leaves the hub here (the engine counted how it ended)."""
        merged: dict[str, pb.DecodeUpdate] = {}
        m = self.metrics
        now = time.monotonic()
        generated = 0
        for request_id, item in items:
            stream = self.streams.get(request_id)
            if isinstance(item, NotAttached):  # about a request this call does not hold: nothing to drop
                merged[request_id + "\0refused"] = _failed_update(request_id, item)
                continue
            if stream is None:
                continue  # ended earlier in this batch, or cancelled
            if not isinstance(item, RequestOutput):
                merged[request_id] = _failed_update(request_id, item)
                self.drop(request_id, finished=True)
                continue
            update = merged.get(request_id)
            if update is None:
                update = merged[request_id] = pb.DecodeUpdate(request_id=request_id)
            if item.new_token_ids:
                if stream.last_token_time is not None:  # tokens merged into one update share their gap
                    gap = (now - stream.last_token_time) / len(item.new_token_ids)
                    for _ in item.new_token_ids:
                        m.itl.observe(gap)
                stream.last_token_time = now
                generated += len(item.new_token_ids)
            update.token_ids.extend(item.new_token_ids)
            update.text += item.new_text
            if item.logprobs is not None:
                update.logprobs.extend(logprobs_to_proto(item.logprobs))
            if item.finished:
                update.finish_reason = finish_to_proto(item.finish_reason)
                update.usage.CopyFrom(usage_to_proto(item.prompt_tokens, item.cached_tokens, len(item.output_ids)))
                self.drop(request_id, finished=True)
        if generated:
            m.count(m.generated_tokens, generated)
        return pb.DecodeStreamResponse(updates=merged.values())


class NotAttached(ServiceError):
    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.NOT_FOUND, message)


def _failed_update(request_id: str, error: BaseException) -> pb.DecodeUpdate:
    """The last update of a request that failed: its status code and why."""
    if isinstance(error, KVTransferError):
        code = grpc.StatusCode.DEADLINE_EXCEEDED if error.kind == "timeout" else grpc.StatusCode.UNAVAILABLE
        text = f"KV transfer failed: {error}"
    else:
        code, text = status_of(error)
    return pb.DecodeUpdate(request_id=request_id, failure=pb.Failure(code=code.value[0], message=text))


__all__ = ["Connection", "RequestStream", "StreamHub"]
