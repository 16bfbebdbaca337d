"""Calls that stay open between the router and one worker and carry many requests' messages both ways (the decode
workers' DecodeStream, the prefill workers' PrefillStream), opened at first use and again after one breaks.

Why: a message on an open call skips what a new call costs both processes (its HTTP/2 stream, call object, task and
interceptors), and what queued meanwhile goes in one message.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Generic, TypeVar

import grpc

from .call_failed import CallFailed
from .workers import Worker

log = logging.getLogger(__name__)

# Commands that queued while the previous message was being written go in one message, up to about this size.
MERGE_BYTES = 4 << 20


class OpenCall:
    """One open call to `worker`: commands (request messages) go out through `send`, each response message goes
    to `receive`, and when the call ends `fail_all` gets the error for every request still on it."""

    kind = "open"  # the method's name, for messages

    def __init__(self, worker: Worker, metadata, seen: Callable[[Worker], None],
                 on_closed: Callable[["OpenCall"], None]):
        self.worker, self.seen, self.on_closed = worker, seen, on_closed
        self._commands: asyncio.Queue = asyncio.Queue()
        self.call = self.open(worker, self._send(), metadata)
        self.reader = asyncio.ensure_future(self._read())

    # ---- what a kind of call defines -----------------------------------------------------------------------------
    def open(self, worker: Worker, commands: AsyncIterator, metadata):
        raise NotImplementedError

    def receive(self, msg) -> None:
        raise NotImplementedError

    def fail_all(self, error: CallFailed) -> None:
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------------------------
    def send(self, command) -> None:
        """Queue `command` for the call's next message."""
        self._commands.put_nowait(command)

    def close(self) -> None:
        self.reader.cancel()

    async def _send(self) -> AsyncIterator:
        while True:
            command = await self._commands.get()
            while not self._commands.empty() and command.ByteSize() < MERGE_BYTES:
                command.MergeFrom(self._commands.get_nowait())  # (appends the repeated fields)
            yield command

    async def _read(self) -> None:
        error = CallFailed(grpc.StatusCode.UNAVAILABLE,
                           f"{self.worker.role} worker {self.worker.address} ended its {self.kind} call")
        try:
            async for msg in self.call:
                self.seen(self.worker)
                self.receive(msg)
        except grpc.aio.AioRpcError as e:
            error = CallFailed(e.code(), e.details() or e.code().name)
        except asyncio.CancelledError:
            error = CallFailed(grpc.StatusCode.UNAVAILABLE, f"the router is closing its {self.kind} calls")
            raise
        finally:
            self.on_closed(self)
            self.call.cancel()
            self.fail_all(error)


C = TypeVar("C", bound=OpenCall)


class OpenCalls(Generic[C]):
    """The router's open calls of one kind, by worker address."""

    def __init__(self, make: Callable[..., C], metadata, seen: Callable[[Worker], None]):
        self.make, self.metadata, self.seen = make, metadata, seen
        self.calls: dict[str, C] = {}

    def to(self, worker: Worker) -> C:
        """The open call to `worker`, opened now if there is none (or the one there is went to an earlier worker
        at that address)."""
        call = self.calls.get(worker.address)
        if call is None or call.worker is not worker:
            call = self.calls[worker.address] = self.make(worker, self.metadata, self.seen, self._closed)
        return call

    def _closed(self, call: C) -> None:
        if self.calls.get(call.worker.address) is call:
            del self.calls[call.worker.address]

    def close(self) -> None:
        for call in list(self.calls.values()):
            call.close()


__all__ = ["MERGE_BYTES", "OpenCall", "OpenCalls"]
