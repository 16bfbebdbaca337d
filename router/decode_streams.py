"""The router's end of the decode workers' DecodeStream calls: one call per decode worker, shared by every request
of this router that decodes there.

A request attaches itself after Reserve and then reads its own queue (its "feed"): the call's reader puts each
DecodeUpdate for it there, and a call that breaks puts a CallFailed into the feed of every request still on it.
One message per engine step comes in for all the requests of the call, instead of one gRPC message, read future
and wake-up per token per request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable

from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb

from .call_failed import CallFailed
from .open_calls import OpenCall, OpenCalls
from .workers import Worker

log = logging.getLogger(__name__)


class DecodeCall(OpenCall):
    """One open DecodeStream call to a decode worker and the feeds of the requests attached to it."""

    kind = "DecodeStream"

    def __init__(self, worker: Worker, metadata, seen: Callable[[Worker], None],
                 on_closed: Callable[[OpenCall], None]):
        self.feeds: dict[str, asyncio.Queue] = {}
        super().__init__(worker, metadata, seen, on_closed)

    def open(self, worker: Worker, commands: AsyncIterator, metadata):
        return worker.stub.DecodeStream(commands, metadata=metadata)

    def attach(self, request_id: str, feed: asyncio.Queue) -> None:
        self.feeds[request_id] = feed
        self.send(pb.DecodeStreamRequest(attach=[request_id]))

    def cancel(self, request_id: str) -> None:
        """The request ended early (client gone, prefill failed, deadline): the worker aborts it."""
        if self.feeds.pop(request_id, None) is not None:
            self.send(pb.DecodeStreamRequest(cancel=[request_id]))

    def receive(self, msg: pb.DecodeStreamResponse) -> None:
        for update in msg.updates:
            feed = self.feeds.get(update.request_id)
            if feed is None:
                continue  # cancelled here meanwhile
            feed.put_nowait(update)
            if update.HasField("failure") or update.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                del self.feeds[update.request_id]  # its last update

    def fail_all(self, error: CallFailed) -> None:
        for feed in self.feeds.values():
            feed.put_nowait(error)
        if self.feeds:
            log.warning("DecodeStream call to %s ended with %d requests on it: %s", self.worker.address,
                        len(self.feeds), error)
        self.feeds.clear()


class DecodeStreams(OpenCalls[DecodeCall]):
    """The router's DecodeStream calls by decode worker address; a call is opened at the first attach and again
    after one breaks."""

    def __init__(self, metadata, seen: Callable[[Worker], None]):
        super().__init__(DecodeCall, metadata, seen)

    def attach(self, worker: Worker, request_id: str, feed: asyncio.Queue) -> DecodeCall:
        call = self.to(worker)
        call.attach(request_id, feed)
        return call


__all__ = ["DecodeCall", "DecodeStreams"]
