"""The router's end of the prefill workers' PrefillStream calls: one call per prefill worker, shared by every
request of this router that prefills there. A prompt, its destination (the Bind) and its cancel go out as messages
on the open call; its answer comes back as a message (prefill_service/prompt_calls.py has the worker's end and why).

A prompt's answer is an asyncio future: its PrefillResponse, or a CallFailed with the status a Prefill call would
have ended with (UNAVAILABLE for every prompt on a call that broke). Cancelling the future cancels the prompt on the
worker.

Keep-warm: a process whose gRPC carried nothing for a while takes twice as long to take in the next message. Bare
grpc.aio between two processes, one message on an open stream after 110 ms quiet: 0.57-0.65 ms on an H200 host,
0.33-0.35 ms with a 1-byte message every 4 ms on another stream of the channel (0.31-0.37 after 2 ms quiet;
`benchmarks/grpc_hop.py --keep-warm-ms 4`). The CPU machine shows the same; there an asyncio loop that merely wakes
every millisecond did not help: what goes cold is gRPC's own threads. At concurrency 1 the prefill worker sits idle
through each request's decode, so every prompt paid it. While no prompt of this call is in flight, and for
`keep_warm_for_s` after the last one, the call carries an empty message whenever it was quiet for `keep_warm_s` (a
prompt in flight is never interrupted: that worker's engine is computing it and a message would only take its engine
thread's GIL). 0 turns it off.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import AsyncIterator, Callable, Optional

from pdserve.v1 import worker_pb2 as pb

from .call_failed import CallFailed, failure_of
from .open_calls import OpenCall, OpenCalls
from .workers import Worker

log = logging.getLogger(__name__)


class PrefillCall(OpenCall):
    """One open PrefillStream call to a prefill worker and the answers its prompts wait for."""

    kind = "PrefillStream"

    def __init__(self, worker: Worker, metadata, seen: Callable[[Worker], None],
                 on_closed: Callable[[OpenCall], None], keep_warm_s: float = 0.0, keep_warm_for_s: float = 0.0):
        self.waiting: dict[str, asyncio.Future] = {}
        self.ended: Optional[CallFailed] = None  # how the call ended, once it has
        self.keep_warm_s, self.keep_warm_for_s = keep_warm_s, keep_warm_for_s
        self._last_prompt = self._last_message = time.monotonic()
        self._prompted = asyncio.Event()  # a prompt came: the keep-warm window opens
        self.num_keep_warm = 0  # empty messages sent
        super().__init__(worker, metadata, seen, on_closed)
        self._warm = asyncio.ensure_future(self._keep_warm()) if keep_warm_s > 0 else None

    def open(self, worker: Worker, commands: AsyncIterator, metadata):
        return worker.stub.PrefillStream(commands, metadata=metadata)

    def prefill(self, request: pb.PrefillRequest) -> asyncio.Future:
        """Sends the prompt; its answer comes in the future returned (cancel it to drop the prompt)."""
        return self.prefill_written(request)[0]

    def prefill_written(self, request: pb.PrefillRequest) -> tuple[asyncio.Future, asyncio.Future]:
        """`prefill`, and a future done once gRPC took the prompt's message (never, if the call ends first: the
        answer fails then)."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        rid = request.request_id
        if self.ended is not None:
            answer.set_exception(CallFailed(self.ended.code(), self.ended.details()))
            return answer, loop.create_future()
        self.waiting[rid] = answer
        answer.add_done_callback(lambda a: a.cancelled() and self._cancel(rid, a))
        written = self.send(pb.PrefillStreamRequest(prefill=[request]))
        self._last_prompt = self._last_message = time.monotonic()
        self._prompted.set()
        return answer, written

    def bind(self, request: pb.BindRequest) -> None:
        """The destination of a prompt sent without one; dropped with the call (its prompt has failed then)."""
        if request.request_id in self.waiting:
            self.send(pb.PrefillStreamRequest(bind=[request]))

    def _cancel(self, rid: str, answer: asyncio.Future) -> None:
        if self.waiting.get(rid) is answer:
            del self.waiting[rid]
            self.send(pb.PrefillStreamRequest(cancel=[rid]))

    def receive(self, msg: pb.PrefillStreamResponse) -> None:
        self._last_message = time.monotonic()
        for a in msg.answers:
            answer = self.waiting.pop(a.request_id, None)
            if answer is None or answer.done():
                continue  # cancelled here meanwhile
            if a.HasField("response"):
                answer.set_result(a.response)
            else:
                answer.set_exception(failure_of(a.failure))

    async def _keep_warm(self) -> None:
        while self.ended is None:
            now = time.monotonic()
            if now - self._last_prompt > self.keep_warm_for_s:  # quiet for long: no messages until a prompt comes
                self._prompted.clear()
                await self._prompted.wait()
                continue
            due = self._last_message + self.keep_warm_s
            if due > now:
                await asyncio.sleep(due - now)
                continue
            if not self.waiting:
                self.send(pb.PrefillStreamRequest())
                self.num_keep_warm += 1
            self._last_message = now  # (a prompt in flight: look again an interval later)

    def fail_all(self, error: CallFailed) -> None:
        self.ended = error
        if self._warm is not None:
            self._warm.cancel()
        waiting, self.waiting = self.waiting, {}
        for answer in waiting.values():
            if not answer.done():
                answer.set_exception(error)
        if waiting:
            log.warning("PrefillStream call to %s ended with %d prompts on it: %s", self.worker.address,
                        len(waiting), error)


class PrefillStreams(OpenCalls[PrefillCall]):
    """The router's PrefillStream calls by prefill worker address; a call is opened at the first prompt and again
    after one breaks. keep_warm_s, keep_warm_for_s: see the module's docstring."""

    def __init__(self, metadata, seen: Callable[[Worker], None], keep_warm_s: float = 0.0,
                 keep_warm_for_s: float = 0.0):
        super().__init__(functools.partial(PrefillCall, keep_warm_s=keep_warm_s, keep_warm_for_s=keep_warm_for_s),
                         metadata, seen)


__all__ = ["PrefillCall", "PrefillStreams"]
