"""The standard gRPC shell every pdserve server uses: grpc.aio, grpc.health.v1, server reflection (v1 and v1alpha),
no SO_REUSEPORT (a taken port is an error, never a shared one), graceful drain on
SIGTERM/SIGINT, and the mapping from pdserve's errors to status codes."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
import weakref
from typing import Awaitable, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_v1alpha_pb2

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


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status an exception maps to: ServiceError keeps its code, ValueError is INVALID_ARGUMENT, else INTERNAL
    (whose Python text goes to the log, never to the caller)."""
    if isinstance(err, ServiceError):
        return err.code, str(err)
    if isinstance(err, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    log.error("internal error: %r", err, exc_info=err)
    return grpc.StatusCode.INTERNAL, "internal error (the server's log has the details)"


async def abort_with(context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """End the call with the status of `err` (status_of)."""
    await context.abort(*status_of(err))


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
    which a router retries elsewhere, while tracked calls already running finish. Keeps every call's task, so that
    a stop can let the calls it ended finish (`calls_ended`)."""

    def __init__(self, tracked: Iterable[str] = (), refused: Iterable[str] = ()):
        self.tracked, self.refused = frozenset(tracked), frozenset(refused)
        self.draining = False
        self.in_flight = 0
        self._calls: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()

    async def calls_ended(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) for the tasks of the calls a stop ended. NOTE: grpc.aio ends a call by
        cancelling its task, which then needs a turn of the loop: a process that returned from asyncio.run first
        would cancel it again, and grpc prints that as a CancelledError traceback."""
        pending = [t for t in self._calls if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        await asyncio.sleep(0)  # (the task grpc wraps each call's task in finishes one turn later)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        task = asyncio.current_task()  # the call's: interceptors run in it
        if task is not None:
            self._calls.add(task)
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


class MessageGuard(grpc.aio.ServerInterceptor):
    """Parses request messages itself, so that bytes which are not a valid message (a string field holding invalid
    UTF-8, corrupt bytes) end with INVALID_ARGUMENT naming the message type, not UNKNOWN carrying protobuf's text;
    and refuses a message that sets two members of one oneof (protobuf would keep the last one silently).

    prechecks: method name -> check(raw bytes), run before the message is parsed; a ServiceError it raises ends the
    call with its status. For bounds on what parsing costs: protobuf parses on the event loop and holds the GIL (a
    thread would not free the loop), so millions of repeated ids must be refused from their size (message_fields)."""

    def __init__(self, prechecks: Optional[Mapping[str, Callable[[bytes], None]]] = None):
        self.prechecks = dict(prechecks or {})

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        parse = getattr(handler, "request_deserializer", None)
        if handler is None or handler.request_streaming or parse is None:
            return handler
        precheck = self.prechecks.get(details.method.rsplit("/", 1)[-1])
        inner = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if handler.response_streaming and not inspect.isasyncgenfunction(inner):
            return handler  # it writes with context.write (grpc.health.v1's Watch): there is nothing to iterate
        descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)

        async def checked(raw: bytes, context) -> object:
            problem = None
            if precheck is not None:
                try:
                    precheck(raw)
                except ServiceError as e:
                    await context.abort(e.code, str(e))
            try:
                request = parse(raw)
            except Exception:  # protobuf's DecodeError, or anything a custom deserializer raises
                what = descriptor.full_name if descriptor is not None else "request"
                problem = (f"the request is not a valid {what} message: a string field holds invalid UTF-8, or the "
                           "bytes are corrupt")
            else:
                problem = _oneof_set_twice(descriptor, raw)
            if problem is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            return request

        if handler.response_streaming:
            async def streaming(raw, context):
                request = await checked(raw, context)
                async for msg in inner(request, context):
                    yield msg
            behavior = streaming
        else:
            async def unary(raw, context):
                return await inner(await checked(raw, context), context)
            behavior = unary
        kinds = {True: grpc.unary_stream_rpc_method_handler, False: grpc.unary_unary_rpc_method_handler}
        return kinds[handler.response_streaming](behavior, request_deserializer=None,
                                                 response_serializer=handler.response_serializer)


def _oneof_set_twice(descriptor, raw: bytes) -> Optional[str]:
    """'prompt: give exactly one of text or tokenized' when the top-level fields of `raw` (a valid message) set two
    members of one oneof; None otherwise."""
    if descriptor is None or not descriptor.oneofs:
        return None
    seen = {number for number, _, _ in message_fields(raw)}
    for oneof in descriptor.oneofs:
        given = [f.name for f in oneof.fields if f.number in seen]
        if len(given) > 1:
            return (f"{oneof.name}: give exactly one of {' or '.join(f.name for f in oneof.fields)} "
                    f"(got {' and '.join(given)})")
    return None


def message_fields(raw) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each top-level field's value in the message `raw` (bytes or a memoryview of
    them), in order, without parsing it: a 16 MB field is one step. Stops where the bytes stop being a message (the
    parser will refuse them)."""
    i, n = 0, len(raw)

    def varint() -> int:
        nonlocal i
        value, shift = 0, 0
        while shift < 70:  # a varint has at most 10 bytes: a longer run is not a message (and would be a long walk)
            b = raw[i]
            i += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7
        raise IndexError("not a varint")

    try:
        while i < n:
            tag = varint()
            wire, start = tag & 7, i
            if wire == 0:
                varint()
            elif wire == 1:
                i += 8
            elif wire == 2:
                length = varint()  # NOTE: not `i += varint()`, which would add to i as it was before the call
                start, i = i, i + length
            elif wire == 5:
                i += 4
            else:
                return  # groups: not used by pdserve's protos
            if i > n:
                return
            yield tag >> 3, start, i
    except IndexError:
        return


class PortInUse(OSError):
    """A server could not bind its port; `flag` (set by the CLI) names the option that chose it."""

    def __init__(self, host: str, port: int, flag: str = "--port"):
        super().__init__(f"{flag}: cannot listen on {host}:{port}: the address is in use (another pdserve, or "
                         f"another program, holds it); pick another port with {flag}")
        self.host, self.port, self.flag = host, port, flag


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _reflection_v1_descriptor() -> None:
    """grpc.reflection.v1 is v1alpha under a new package, message for message (grpcio-reflection ships only
    v1alpha): its file is added to the default pool so that reflection can describe the v1 service too."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_v1alpha_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    for msg in fdp.message_type:
        for f in msg.field:
            if f.type_name:  # NOTE: assigning "" would mark it set, which the pool refuses for scalar fields
                f.type_name = f.type_name.replace(old, new)
    for service in fdp.service:
        for m in service.method:
            m.input_type, m.output_type = m.input_type.replace(old, new), m.output_type.replace(old, new)
    pool.Add(fdp)


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Server reflection in both versions clients speak: v1 (grpcurl, Postman, newer grpc libraries) and v1alpha
    (older ones), one servicer behind both: their messages are the same on the wire."""
    _reflection_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer(service_names + [reflection.SERVICE_NAME, REFLECTION_V1])
    reflection._reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_v1alpha_pb2.ServerReflectionResponse.SerializeToString)}),))


def create_server(host: str, port: int, service_names: Iterable[str],
                  add_servicers: Callable[[grpc.aio.Server], None], *, options: Optional[Sequence[tuple]] = None,
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = (), drain: Optional[Drain] = None,
                  credentials: Optional[grpc.ServerCredentials] = None,
                  prechecks: Optional[Mapping[str, Callable[[bytes], None]]] = None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with our servicers, health (SERVING for each service) and reflection. Returns (server,
    bound port); port 0 picks a free one. `interceptors` run first (authentication), then `drain`; with
    `credentials` the port speaks TLS; `prechecks`: see MessageGuard."""
    drain = drain or Drain()
    # NOTE: so_reuseport off: gRPC's default lets a second server bind the same port, and the kernel then splits new
    # connections between the two (two stacks' answers silently mixed); off, the second bind fails (PortInUse).
    opts = [o for o in (options or CHANNEL_OPTIONS) if o[0] != "grpc.so_reuseport"] + [("grpc.so_reuseport", 0)]
    # MessageGuard last (innermost): the handlers of the others pass the raw bytes through to it.
    server = grpc.aio.server(options=opts, interceptors=[*interceptors, drain, MessageGuard(prechecks)])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    add_reflection(server, names + [health.SERVICE_NAME])
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpcio >= 1.60 raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise PortInUse(host, port)
    server._pdserve_health = health_servicer  # type: ignore[attr-defined]
    server._pdserve_services = names  # type: ignore[attr-defined]
    server._pdserve_drain = drain  # type: ignore[attr-defined]
    return server, bound


async def start_serving(server: grpc.aio.Server, serving: bool = True) -> None:
    """Start the server, reporting SERVING (or, `serving` False, NOT_SERVING: see set_serving)."""
    await server.start()
    await set_serving(server, serving)


async def set_serving(server: grpc.aio.Server, serving: bool) -> None:
    """Report SERVING or NOT_SERVING for every service of the server and for the server as a whole (""), for a
    server whose readiness depends on others (a router on its workers). Ignored once the drain began."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    h = server._pdserve_health  # type: ignore[attr-defined]
    for name in [""] + server._pdserve_services:  # type: ignore[attr-defined]
        await h.set(name, status)


# Once nothing is in flight, the calls still open carry no work (a router's PrefillStream or DecodeStream between
# requests, a health Watch): a stop gives them this long to write what they already answered, then ends them.
IDLE_CALLS_GRACE_S = 0.1


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM, SIGINT (Ctrl-C) or SIGHUP (the terminal closed) on the running loop. Installed first
    thing by a server, so a signal during its start-up also ends in the drain (not a KeyboardInterrupt raised in the
    middle of starting servers)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until_signal(server: grpc.aio.Server, grace_s: float,
                             on_stop: Optional[Callable[[], Awaitable[None]]] = None,
                             stop: Optional[asyncio.Event] = None) -> None:
    """Run until SIGTERM/SIGINT/SIGHUP (or `stop`, from stop_on_signals, is set), then drain: health reports
    NOT_SERVING, new work is refused with UNAVAILABLE, work in flight gets up to grace_s to finish; then the server
    stops (cancelling what is left) and on_stop runs.
    An idle process has nothing to wait for and stops at once: its closed port takes it out of a router's rotation
    as surely as a NOT_SERVING answer would (a refused check counts at once)."""
    stop = stop or stop_on_signals()
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
    await server.stop(1.0 if drain.in_flight else IDLE_CALLS_GRACE_S)
    await drain.calls_ended(1.0)
    if on_stop is not None:
        await on_stop()
