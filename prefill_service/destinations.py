"""Where the KV of a prompt sent without a destination goes: the router reserves pages on the decode worker while
the prompt is computed, then sends the reservation as its bind (a PrefillStream message, or a Bind call). Prompt
and bind may overtake each other (two calls; on one stream they do not), so each request id has a mailbox that
whichever comes first opens. Everything here runs on the event loop."""

from __future__ import annotations

import asyncio
from typing import Optional

import grpc

from pdserve.serving.grpc_shell import ServiceError
from pdserve.v1 import worker_pb2 as pb

# A Bind whose Prefill never comes (it failed before it got here, or was cancelled) is forgotten after this long.
UNCLAIMED_BIND_S = 60.0


class Destinations:
    def __init__(self, unclaimed_s: float = UNCLAIMED_BIND_S):
        self.unclaimed_s = unclaimed_s
        self._boxes: dict[str, asyncio.Future] = {}

    def __len__(self) -> int:
        return len(self._boxes)

    def put(self, request_id: str, destination: pb.ReserveResponse) -> None:
        """The Bind call's part; ALREADY_EXISTS for a second destination of one request."""
        box = self._boxes.get(request_id)
        if box is None:
            box = self._open(request_id)
            # Nobody may ever take it: the Prefill failed on its way here, or ended before its Bind came.
            asyncio.get_running_loop().call_later(self.unclaimed_s, self._forget, request_id, box)
        if box.done():
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {request_id!r} already has a KV destination")
        box.set_result(destination)

    async def take(self, request_id: str, timeout_s: Optional[float]) -> pb.ReserveResponse:
        """The Prefill call's part: waits for the destination (DEADLINE_EXCEEDED after timeout_s); the mailbox
        closes however the wait ends."""
        box = self._boxes.get(request_id) or self._open(request_id)
        try:
            return await asyncio.wait_for(asyncio.shield(box), timeout_s)
        except asyncio.TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no KV destination (Bind) came for request {request_id!r} within {timeout_s:g} s"
                               ) from None
        finally:
            self._forget(request_id, box)

    def _open(self, request_id: str) -> asyncio.Future:
        box = self._boxes[request_id] = asyncio.get_running_loop().create_future()
        return box

    def _forget(self, request_id: str, box: asyncio.Future) -> None:
        if self._boxes.get(request_id) is box:
            del self._boxes[request_id]


__all__ = ["Destinations", "UNCLAIMED_BIND_S"]
