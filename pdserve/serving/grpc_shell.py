"""The standard gRPC shell every pdserve server uses: grpc.aio, grpc.health.v1, server reflection, graceful drain on
SIGTERM/SIGINT, and the mapping from pdserve's errors to status codes."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Awaitable, Callable, Iterable, Optional, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Internal channels: a worker restarted on the same address is dialled again within ~2 s (gRPC's default backoff
# grows to 120 s, which would keep a recovered worker out of rotation for minutes).
INTERNAL_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [("grpc.initial_reconnect_backoff_ms", 200),
                                              ("grpc.min_reconnect_backoff_ms", 200),
                                              ("grpc.max_reconnect_backoff_ms", 2000)]
log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error with the status code the client should see; raised below the servicers, mapped at the edge."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


async def abort_with(context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """Map an exception to a status: ServiceError keeps its code, ValueError is INVALID_ARGUMENT, else INTERNAL."""
    if isinstance(err, ServiceError):
        await context.abort(err.code, str(err))
    if isinstance(err, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")


def deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends every call with `code`."""
    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # never reached: makes this an async generator, as a streaming handler must be

    return _same_kind(handler, streaming if handler.response_streaming else unary)


def _same_kind(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class Drain(grpc.aio.ServerInterceptor):
    """Graceful drain. Counts the calls doing work (`tracked` method names); once `draining`, calls to `refused`
    methods (new work: Generate, Reserve, Prefill, and GetLoad so routers drop this worker) end with UNAVAILABLE,
    which a router retries elsewhere, while tracked calls already running finish."""

    def __init__(self, tracked: Iterable[str] = (), refused: Iterable[str] = ()):
        self.tracked, self.refused = frozenset(tracked), frozenset(refused)
        self.draining = False
        self.in_flight = 0

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        name = details.method.rsplit("/", 1)[-1]
        if self.draining and name in self.refused:
            return deny(handler, grpc.StatusCode.UNAVAILABLE, "this server is draining (shutting down): retry on "
                                                              "another one")
        if name not in self.tracked or handler.request_streaming:
            return handler
        if handler.response_streaming:
            inner = handler.unary_stream

            async def streaming(request, context):
                self.in_flight += 1
                try:
                    async for msg in inner(request, context):
                        yield msg
                finally:
                    self.in_flight -= 1
            return _same_kind(handler, streaming)
        inner = handler.unary_unary

        async def unary(request, context):
            self.in_flight += 1
            try:
                return await inner(request, context)
            finally:
                self.in_flight -= 1
        return _same_kind(handler, unary)


def create_server(host: str, port: int, service_names: Iterable[str],
                  add_servicers: Callable[[grpc.aio.Server], None], *, options: Optional[Sequence[tuple]] = None,
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = (), drain: Optional[Drain] = None,
                  credentials: Optional[grpc.ServerCredentials] = None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with our servicers, health (SERVING for each service) and reflection. Returns (server,
    bound port); port 0 picks a free one. `interceptors` run first (authentication), then `drain`; with
    `credentials` the port speaks TLS."""
    drain = drain or Drain()
    server = grpc.aio.server(options=list(options or CHANNEL_OPTIONS), interceptors=[*interceptors, drain])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (in use?)")
    server._pdserve_health = health_servicer  # type: ignore[attr-defined]
    server._pdserve_services = names  # type: ignore[attr-defined]
    server._pdserve_drain = drain  # type: ignore[attr-defined]
    return server, bound


async def start_serving(server: grpc.aio.Server) -> None:
    await server.start()
    h = server._pdserve_health  # type: ignore[attr-defined]
    for name in [""] + server._pdserve_services:  # type: ignore[attr-defined]
        await h.set(name, health_pb2.HealthCheckResponse.SERVING)


async def serve_until_signal(server: grpc.aio.Server, grace_s: float,
                             on_stop: Optional[Callable[[], Awaitable[None]]] = None) -> None:
    """Run until SIGTERM/SIGINT, then drain: health reports NOT_SERVING, new work is refused with UNAVAILABLE,
    work in flight gets up to grace_s to finish; then the server stops (cancelling what is left) and on_stop runs."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    await asyncio.wait([waiter, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    await server._pdserve_health.enter_graceful_shutdown()  # type: ignore[attr-defined]
    drain: Drain = server._pdserve_drain  # type: ignore[attr-defined]
    drain.draining = True
    deadline = time.monotonic() + grace_s
    while drain.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if drain.in_flight:
        log.warning("drain timeout (%.0f s) reached with %d calls in flight: cancelling them", grace_s,
                    drain.in_flight)
    await server.stop(1.0)
    if on_stop is not None:
        await on_stop()
