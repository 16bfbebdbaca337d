"""The router's end of the decode workers' DecodeStream calls: one call per decode worker, shared by every request
of this router that decodes there.

A request attaches itself after Reserve and then reads its own queue (its "feed"): the call's reader puts each
DecodeUpdate for it there, and a call that breaks puts a DecodeFailed into the feed of every request still on it.
One message per engine step comes in for all the requests of the call, instead of one gRPC message, read future
and wake-up per token per request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable

import grpc

from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb

from .workers import Worker

log = logging.getLogger(__name__)


class DecodeFailed(Exception):
    """A request's decode ended with a status: its failure update, or the call it was on broke (then UNAVAILABLE,
    retried elsewhere when nothing was streamed yet). Reads like grpc.aio.AioRpcError (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class DecodeCall:
    """One open DecodeStream call to a decode worker and the feeds of the requests attached to it."""

    def __init__(self, worker: Worker, metadata, seen: Callable[[Worker], None],
                 on_closed: Callable[["DecodeCall"], None]):
        self.worker, self.seen, self.on_closed = worker, seen, on_closed
        self.feeds: dict[str, asyncio.Queue] = {}
        self._commands: asyncio.Queue[pb.DecodeStreamRequest] = asyncio.Queue()
        self.call = worker.stub.DecodeStream(self._send(), metadata=metadata)
        self.reader = asyncio.ensure_future(self._read())

    def attach(self, request_id: str, feed: asyncio.Queue) -> None:
        self.feeds[request_id] = feed
        self._commands.put_nowait(pb.DecodeStreamRequest(attach=[request_id]))

    def cancel(self, request_id: str) -> None:
        """The request ended early (client gone, prefill failed, deadline): the worker aborts it."""
        if self.feeds.pop(request_id, None) is not None:
            self._commands.put_nowait(pb.DecodeStreamRequest(cancel=[request_id]))

    def close(self) -> None:
        self.reader.cancel()

    async def _send(self) -> AsyncIterator[pb.DecodeStreamRequest]:
        while True:
            command = await self._commands.get()
            while not self._commands.empty():  # what queued meanwhile goes in one message
                later = self._commands.get_nowait()
                command.attach.extend(later.attach)
                command.cancel.extend(later.cancel)
            yield command

    async def _read(self) -> None:
        error = DecodeFailed(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker.address} ended its "
                             "DecodeStream call")
        try:
            async for msg in self.call:
                self.seen(self.worker)
                for update in msg.updates:
                    feed = self.feeds.get(update.request_id)
                    if feed is None:
                        continue  # cancelled here meanwhile
                    feed.put_nowait(update)
                    if update.HasField("failure") or update.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                        del self.feeds[update.request_id]  # its last update
        except grpc.aio.AioRpcError as e:
            error = DecodeFailed(e.code(), e.details() or e.code().name)
        except asyncio.CancelledError:
            error = DecodeFailed(grpc.StatusCode.UNAVAILABLE, "the router is closing its decode calls")
            raise
        finally:
            self.on_closed(self)
            self.call.cancel()
            for feed in self.feeds.values():
                feed.put_nowait(error)
            if self.feeds:
                log.warning("DecodeStream call to %s ended with %d requests on it: %s", self.worker.address,
                            len(self.feeds), error)
            self.feeds.clear()


class DecodeStreams:
    """The router's DecodeStream calls by decode worker address; a call is opened at the first attach and again
    after one breaks."""

    def __init__(self, metadata, seen: Callable[[Worker], None]):
        self.metadata, self.seen = metadata, seen
        self.calls: dict[str, DecodeCall] = {}

    def attach(self, worker: Worker, request_id: str, feed: asyncio.Queue) -> DecodeCall:
        call = self.calls.get(worker.address)
        if call is None or call.worker is not worker:
            call = self.calls[worker.address] = DecodeCall(worker, self.metadata, self.seen, self._closed)
        call.attach(request_id, feed)
        return call

    def _closed(self, call: DecodeCall) -> None:
        if self.calls.get(call.worker.address) is call:
            del self.calls[call.worker.address]

    def close(self) -> None:
        for call in list(self.calls.values()):
            call.close()


def failure_of(update: pb.DecodeUpdate) -> DecodeFailed:
    code = _CODES.get(update.failure.code, grpc.StatusCode.UNKNOWN)
    return DecodeFailed(code, update.failure.message)


__all__ = ["DecodeCall", "DecodeFailed", "DecodeStreams", "failure_of"]
