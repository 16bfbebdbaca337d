"""The prefill worker's end of a PrefillStream call: one router's prompts, their destinations (binds) and its cancels
come in as messages on one open call, and each prompt's answer (its PrefillResponse or its failure) goes back on it,
the answers that finish together in one message.

Why a call that stays open: a new call costs both processes an HTTP/2 stream, a call object, a task and the
interceptors, on the prefill worker's event loop while the engine thread wants the GIL; a message on an open call
pays none of those (benchmarks/grpc_hop.py measures both). A prompt crosses two such hops to its first token
(router -> prefill worker and back).

What a prompt does, and how it fails, is PrefillServicer.prefill's (passed in): this file carries messages and hands
each prompt its bind. Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import grpc

from pdserve.common.trace import mark
from pdserve.serving.grpc_shell import Drain, ServiceError, invalid, status_of
from pdserve.v1 import worker_pb2 as pb

_END = object()  # the router closed its side of the call


@dataclass
class _Prompt:
    task: asyncio.Task
    destination: asyncio.Future  # its bind's ReserveResponse, set when the bind comes


class PromptCall:
    """One PrefillStream call. `prefill(request, destination)`: one prompt to its answer (raises ServiceError),
    `destination` a future of its bind's ReserveResponse; `drain`: the server's (a draining worker answers new
    prompts UNAVAILABLE, and waits for those in flight)."""

    def __init__(self, prefill: Callable[[pb.PrefillRequest, Awaitable[pb.ReserveResponse]],
                                         Awaitable[pb.PrefillResponse]], drain: Drain):
        self.prefill, self.drain = prefill, drain
        self.jobs: dict[str, _Prompt] = {}  # prompts in flight by request id
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
                job.task.cancel()  # its cleanup drops the prompt from the engine and aborts its transfer

    async def _read(self, requests: AsyncIterator[pb.PrefillStreamRequest]) -> None:
        try:
            async for msg in requests:
                for request in msg.prefill:
                    self._start(request)
                for request in msg.bind:
                    try:
                        self._bind(request)
                    except ServiceError as e:  # the prompt waiting for it would wait out its timeout
                        self._end(request.request_id, e)
                for request_id in msg.cancel:
                    job = self.jobs.pop(request_id, None)
                    if job is not None:
                        job.task.cancel()
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
            destination = asyncio.get_running_loop().create_future()
            self.jobs[rid] = _Prompt(asyncio.ensure_future(self._run(request, destination)), destination)

    def _bind(self, request: pb.BindRequest) -> None:
        """Hands the prompt its destination; ServiceError when it cannot take it. A bind whose prompt is no longer
        in flight (it failed, or the router cancelled it) has nobody to go to, and is dropped."""
        rid = request.request_id
        prompt = self.jobs.get(rid)
        if prompt is None:
            return
        if not request.HasField("destination"):
            raise invalid("destination: missing (the decode worker's ReserveResponse)")
        if prompt.destination.done():
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} already has a KV destination")
        mark("prefill.bind", rid)
        prompt.destination.set_result(request.destination)

    async def _run(self, request: pb.PrefillRequest, destination: asyncio.Future) -> None:
        rid = request.request_id
        # Counted here, not where the task is made: a task cancelled before it starts never runs its finally.
        self.drain.in_flight += 1  # a stop waits for it
        try:
            answer = pb.PrefillAnswer(request_id=rid, response=await self.prefill(request, destination))
        except asyncio.CancelledError:
            raise  # cancelled by the router, or the call ended: nobody waits for an answer
        except Exception as e:  # noqa: BLE001 (ServiceError, or anything unexpected: INTERNAL, logged)
            answer = _failure(rid, *status_of(e))
        finally:
            self.drain.in_flight -= 1
            job = self.jobs.get(rid)
            if job is not None and job.task is asyncio.current_task():
                del self.jobs[rid]
        self._out.put_nowait(answer)

    def _end(self, rid: str, error: ServiceError) -> None:
        """A prompt fails before its own end (its destination was refused): dropped, and answered with `error`."""
        job = self.jobs.pop(rid, None)
        if job is not None:
            job.task.cancel()
        self._answer_failure(rid, error.code, str(error))

    def _answer_failure(self, rid: str, code: grpc.StatusCode, details: str) -> None:
        self._out.put_nowait(_failure(rid, code, details))


def _failure(rid: str, code: grpc.StatusCode, details: str) -> pb.PrefillAnswer:
    return pb.PrefillAnswer(request_id=rid, failure=pb.Failure(code=code.value[0], message=details))


__all__ = ["PromptCall"]
