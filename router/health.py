"""The router's health, one truth for both its fronts: HTTP `GET /health` (200 or 503) and grpc.health.v1 (SERVING or
NOT_SERVING), which Kubernetes' readiness probe and the images' HEALTHCHECK ask. A router can serve while it is not
draining and has a healthy prefill worker and a healthy decode worker; without them every request would wait for one
and end UNAVAILABLE, so a load balancer should send its traffic to another router."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from pdserve.serving.grpc_shell import set_serving

from .workers import WorkerPool

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
# How often the gRPC status is brought up to date with the pool, whose checks run every --health-check-interval
# (1 s by default): a worker that goes out of routing shows on both fronts within this of each other.
FOLLOW_INTERVAL_S = 0.1


@dataclass(frozen=True)
class RouterHealth:
    serving: bool
    reason: str  # why not ("" while serving)
    workers: dict  # role -> healthy workers


def router_health(pool: WorkerPool, draining: bool) -> RouterHealth:
    workers = {role: len(pool.of_role(role)) for role in ROLES}
    if draining:
        return RouterHealth(False, "this router is draining (shutting down)", workers)
    if not all(workers.values()):
        return RouterHealth(False, f"no healthy workers: {workers['prefill']} prefill, {workers['decode']} decode",
                            workers)
    return RouterHealth(True, "", workers)


async def follow_health(server: grpc.aio.Server, pool: WorkerPool, serving: bool) -> None:
    """Keeps `server`'s grpc.health.v1 status (every service, and the server as a whole) equal to `router_health`,
    from `serving` (the status it was started with) on. Runs until cancelled; the drain's NOT_SERVING, set by the
    gRPC shell, is final."""
    while True:
        await asyncio.sleep(FOLLOW_INTERVAL_S)
        health = router_health(pool, draining=False)
        if health.serving != serving:
            serving = health.serving
            if serving:
                log.info("router health: SERVING (%d prefill, %d decode workers)", health.workers["prefill"],
                         health.workers["decode"])
            else:
                log.warning("router health: NOT_SERVING (%s)", health.reason)
            await set_serving(server, serving)


__all__ = ["RouterHealth", "router_health", "follow_health"]
