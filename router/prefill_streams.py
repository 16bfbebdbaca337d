"""The router's end of the prefill workers' PrefillStream calls: one call per prefill worker, shared by every
request of this router that prefills there. A prompt, its destination (the Bind) and its cancel go out as messages
on the open call; its answer comes back as a message (prefill_service/prompt_calls.py has the worker's end and why).

A prompt's answer is an asyncio future: its PrefillResponse, or a CallFailed with the status the worker failed it
with (UNAVAILABLE for every prompt on a call that broke). Cancelling the future cancels the prompt on the worker.
"""

from __future__ import annotations

import asyncio
import logging
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
                 on_closed: Callable[[OpenCall], None]):
        self.waiting: dict[str, asyncio.Future] = {}
        self.ended: Optional[CallFailed] = None  # how the call ended, once it has
        super().__init__(worker, metadata, seen, on_closed)

    def open(self, worker: Worker, commands: AsyncIterator, metadata):
        return worker.stub.PrefillStream(commands, metadata=metadata)

    def prefill(self, request: pb.PrefillRequest) -> asyncio.Future:
        """Sends the prompt; its answer comes in the future returned (cancel it to drop the prompt)."""
        answer = asyncio.get_running_loop().create_future()
        rid = request.request_id
        if self.ended is not None:
            answer.set_exception(CallFailed(self.ended.code(), self.ended.details()))
            return answer
        self.waiting[rid] = answer
        answer.add_done_callback(lambda a: a.cancelled() and self._cancel(rid, a))
        self.send(pb.PrefillStreamRequest(prefill=[request]))
        return answer

    def bind(self, request: pb.BindRequest) -> None:
        """The destination of a prompt sent without one; dropped with the call (its prompt has failed then)."""
        if request.request_id in self.waiting:
            self.send(pb.PrefillStreamRequest(bind=[request]))

    def _cancel(self, rid: str, answer: asyncio.Future) -> None:
        if self.waiting.get(rid) is answer:
            del self.waiting[rid]
            self.send(pb.PrefillStreamRequest(cancel=[rid]))

    def receive(self, msg: pb.PrefillStreamResponse) -> None:
        for a in msg.answers:
            answer = self.waiting.pop(a.request_id, None)
            if answer is None or answer.done():
                continue  # cancelled here meanwhile
            if a.HasField("response"):
                answer.set_result(a.response)
            else:
                answer.set_exception(failure_of(a.failure))

    def fail_all(self, error: CallFailed) -> None:
        self.ended = error
        waiting, self.waiting = self.waiting, {}
        for answer in waiting.values():
            if not answer.done():
                answer.set_exception(error)
        if waiting:
            log.warning("PrefillStream call to %s ended with %d prompts on it: %s", self.worker.address,
                        len(waiting), error)


class PrefillStreams(OpenCalls[PrefillCall]):
    """The router's PrefillStream calls by prefill worker address; a call is opened at the first prompt and again
    after one breaks."""

    def __init__(self, metadata, seen: Callable[[Worker], None]):
        super().__init__(PrefillCall, metadata, seen)


__all__ = ["PrefillCall", "PrefillStreams"]
