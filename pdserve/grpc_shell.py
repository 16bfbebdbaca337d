"""The standard gRPC shell every pdserve server uses: grpc.aio, grpc.health.v1, server reflection, graceful stop on
SIGTERM/SIGINT, and the mapping from pdserve's errors to status codes."""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable, Iterable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


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


def create_server(host: str, port: int, service_names: Iterable[str],
                  add_servicers: Callable[[grpc.aio.Server], None]) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with our servicers, health (SERVING for each service) and reflection. Returns (server,
    bound port); port 0 picks a free one."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (in use?)")
    server._pdserve_health = health_servicer  # type: ignore[attr-defined]
    server._pdserve_services = names  # type: ignore[attr-defined]
    return server, bound


async def start_serving(server: grpc.aio.Server) -> None:
    await server.start()
    h = server._pdserve_health  # type: ignore[attr-defined]
    for name in [""] + server._pdserve_services:  # type: ignore[attr-defined]
        await h.set(name, health_pb2.HealthCheckResponse.SERVING)


async def serve_until_signal(server: grpc.aio.Server, grace_s: float,
                             on_stop: Optional[Callable[[], Awaitable[None]]] = None) -> None:
    """Run until SIGTERM/SIGINT, then report NOT_SERVING, drain for grace_s, and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    await asyncio.wait([waiter, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    await server._pdserve_health.enter_graceful_shutdown()  # type: ignore[attr-defined]
    await server.stop(grace_s)
    if on_stop is not None:
        await on_stop()
