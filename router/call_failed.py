"""How one request ends on a call that carries many (DecodeStream, PrefillStream): its failure message, or the call
breaking under it."""

from __future__ import annotations

import grpc

from pdserve.v1 import worker_pb2 as pb

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class CallFailed(Exception):
    """A request's part on a worker ended with a status: its own failure message, or the call it was on broke (then
    UNAVAILABLE, retried elsewhere when nothing was streamed yet). Reads like grpc.aio.AioRpcError (code(),
    details())."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def failure_of(failure: pb.Failure) -> CallFailed:
    return CallFailed(_CODES.get(failure.code, grpc.StatusCode.UNKNOWN), failure.message)


__all__ = ["CallFailed", "failure_of"]
