"""The prefill worker's end of a PrefillStream call: one router's prompts, their destinations and its cancels come in
as messages on one open call, and each prompt's answer (its PrefillResponse or its failure) goes back on it, the
answers that finish together in one message.

Why a call that stays open: a unary call costs both processes a new HTTP/2 stream, a call object, a task and the
interceptors, on the prefill worker's event loop while the engine thread wants the GIL; a message on an open call
costs about half as much after the same idle (benchmarks/grpc_hop.py on an H200 host: 0.66 vs 1.23 ms one way
after 110 ms). A prompt at c=1 crosses two such hops to its first token (router -> prefill worker and back).

What a prompt does, and how it fails, is the Prefill call's (PrefillServicer.prefill, passed in): this file only
carries messages. Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

import grpc

from pdserve.serving.grpc_shell import Drain, ServiceError, status_of
from pdserve.v1 import worker_pb2 as pb

_END = object()  # the router closed its side of the call


class PromptCall:
    """One PrefillStream call. `prefill`: one prompt to its answer (raises ServiceError); `bind`: takes a
    destination (raises ServiceError); `drain`: the server's (a draining worker answers new prompts UNAVAILABLE, and waits for those in flight)."""

    def __init__(self, prefill: Callable[[pb.PrefillRequest], Awaitable[pb.PrefillResponse]],
                 bind: Callable[[pb.BindRequest], None], drain: Drain):
        self.prefill, self.bind, self.drain = prefill, bind, drain
        self.jobs: dict[str, asyncio.Task] = {}  # prompts in flight by request id
        self._out: asyncio.Queue = asyncio.Queue()  # PrefillAnswer, _END, or the exception the reading ended with

    async def serve(self, requests: AsyncIterator[pb.PrefillStreamRequest]) -> AsyncIterator[pb.PrefillStreamResponse]:
        """The call's responses until the router closes its side and every prompt is answered. However it ends
        (the router cancels the call, the server stops), the prompts still in flight are dropped."""
        reader = asyncio.ensure_future(self._read(requests))
        closed = False
        try:
            while not (closed and not self.jobs):
                item = await self._out.get()
                items = [item]
                while not self._out.empty():
                    items.append(self._out.get_nowait())
                answers = []
                for item in items:
                    if item is _END:
                        closed = True
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        answers.append(item)
                if answers:
                    yield pb.PrefillStreamResponse(answers=answers)
        finally:
            reader.cancel()
            for job in list(self.jobs.values()):
                job.cancel()  # its cleanup drops the prompt from the engine and aborts its transfer

    async def _read(self, requests: AsyncIterator[pb.PrefillStreamRequest]) -> None:
        try:
            async for msg in requests:
                for request in msg.prefill:
                    self._start(request)
                for request in msg.bind:
                    try:
                        self.bind(request)
                    except ServiceError as e:  # the prompt waiting for it would wait out its timeout
                        self._end(request.request_id, e)
                for request_id in msg.cancel:
                    job = self.jobs.pop(request_id, None)
                    if job is not None:
                        job.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 (the call broke: serve() ends it with this)
            self._out.put_nowait(e)
            return
        self._out.put_nowait(_END)

    def _start(self, request: pb.PrefillRequest) -> None:
        rid = request.request_id
        if self.drain.draining:
            self._answer_failure(rid, grpc.StatusCode.UNAVAILABLE,
                                 "this server is draining (shutting down): retry on another one")
        elif not rid:
            self._answer_failure(rid, grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        elif rid in self.jobs:
            self._answer_failure(rid, grpc.StatusCode.ALREADY_EXISTS,
                                 f"request_id {rid!r} is already in flight on this call")
        else:
            self.jobs[rid] = asyncio.ensure_future(self._run(request))

    async def _run(self, request: pb.PrefillRequest) -> None:
        rid = request.request_id
        # Counted here, not where the task is made: a task cancelled before it starts never runs its finally.
        self.drain.in_flight += 1  # a stop waits for it, as for a Prefill call
        try:
            answer = pb.PrefillAnswer(request_id=rid, response=await self.prefill(request))
        except asyncio.CancelledError:
            raise  # cancelled by the router, or the call ended: nobody waits for an answer
        except Exception as e:  # noqa: BLE001 (ServiceError, or anything unexpected: INTERNAL, logged)
            answer = _failure(rid, *status_of(e))
        finally:
            self.drain.in_flight -= 1
            if self.jobs.get(rid) is asyncio.current_task():
                del self.jobs[rid]
        self._out.put_nowait(answer)

    def _end(self, rid: str, error: ServiceError) -> None:
        """A prompt fails before its own end (its destination was refused): dropped, and answered with `error`."""
        job = self.jobs.pop(rid, None)
        if job is not None:
            job.cancel()
        self._answer_failure(rid, error.code, str(error))

    def _answer_failure(self, rid: str, code: grpc.StatusCode, details: str) -> None:
        self._out.put_nowait(_failure(rid, code, details))


def _failure(rid: str, code: grpc.StatusCode, details: str) -> pb.PrefillAnswer:
    return pb.PrefillAnswer(request_id=rid, failure=pb.Failure(code=code.value[0], message=details))


__all__ = ["PromptCall"]
