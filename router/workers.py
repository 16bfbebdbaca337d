"""The router's view of the workers: static addresses and/or those registered in Redis, each with its identity,
KV layout and a recent load sample; plus the choice of a prefill and a decode worker for a request."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import grpc

from pdserve.serving.auth import SecurityConfig
from pdserve.serving.grpc_shell import INTERNAL_CHANNEL_OPTIONS
from pdserve.common.values import KVLayout
from pdserve.serving.rpc_convert import layout_from_proto
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
ROLE_STUBS = {"prefill": pb_grpc.PrefillWorkerStub, "decode": pb_grpc.DecodeWorkerStub}


@dataclass
class Worker:
    address: str
    role: str
    channel: grpc.aio.Channel
    stub: object
    info: Optional[pb.WorkerInfo] = None
    load: Optional[pb.WorkerLoad] = None
    healthy: bool = False
    in_flight: int = 0  # requests this router has sent and not seen finish (fresher than the polled load)
    last_ok: float = field(default_factory=time.monotonic)

    @property
    def layout(self) -> Optional[KVLayout]:
        return layout_from_proto(self.info.layout) if self.info is not None else None

    @property
    def busy(self) -> int:
        """Requests in the worker right now, as well as the router knows."""
        polled = (self.load.num_running_requests + self.load.num_waiting_requests) if self.load else 0
        return max(polled, self.in_flight)


class WorkerPool:
    def __init__(self, static: dict[str, list[str]], discover=None, refresh_s: float = 1.0,
                 security: SecurityConfig = SecurityConfig()):
        """static: role -> addresses; discover(role) -> list of addresses (Redis registry) or None. A worker is
        healthy while its polls succeed: one that dies (or drains) drops out within refresh_s, one that comes back
        at a known address (static, or registered again in Redis) rejoins at the next poll."""
        self.workers: dict[str, Worker] = {}
        self._static, self._discover, self.refresh_s = static, discover, refresh_s
        self.security = security
        self.metadata = security.internal_metadata()  # sent with every call to a worker
        for role, addresses in static.items():
            for a in addresses:
                self._add(a, role)
        self._task: Optional[asyncio.Task] = None

    def _add(self, address: str, role: str) -> Worker:
        channel = self.security.channel(address, INTERNAL_CHANNEL_OPTIONS)
        w = Worker(address, role, channel, ROLE_STUBS[role](channel))
        self.workers[address] = w
        return w

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def poll_soon(self, *workers: Worker) -> None:
        """Re-check workers now (a call to them just failed): a dead one is out of rotation at once, not at the
        next refresh."""
        for w in workers:
            asyncio.ensure_future(self._poll(w))

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for w in self.workers.values():
            await w.channel.close()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # never let a refresh error end the loop
                log.exception("refreshing workers failed")

    async def refresh(self) -> None:
        if self._discover is not None:
            for role in ROLE_STUBS:
                found = await asyncio.to_thread(self._discover, role)
                if found is None:
                    continue  # registry unreachable: keep what we know
                for address in found:
                    if address not in self.workers:
                        self._add(address, role)
                static = set(self._static.get(role, []))
                for address, w in list(self.workers.items()):
                    if w.role == role and address not in found and address not in static and not w.healthy:
                        await w.channel.close()
                        del self.workers[address]
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))

    async def _poll(self, w: Worker) -> None:
        try:
            if w.info is None:
                w.info = await w.stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=2.0, metadata=self.metadata)
            w.load = await w.stub.GetLoad(pb.GetLoadRequest(), timeout=2.0, metadata=self.metadata)
            w.healthy, w.last_ok = True, time.monotonic()
        except grpc.aio.AioRpcError as e:
            if w.healthy:
                log.warning("%s worker %s unreachable: %s", w.role, w.address, e.code().name)
            w.healthy = False
            w.info = None  # it may come back as a different process


def _rotate_best(workers: list[Worker], key, turn: int) -> Optional[Worker]:
    """The best worker by key; ties broken round-robin by turn, so idle workers share sequential traffic."""
    if not workers:
        return None
    best = min(key(w) for w in workers)
    tied = sorted((w for w in workers if key(w) == best), key=lambda w: w.address)
    return tied[turn % len(tied)]


def pick_decode(workers: list[Worker], turn: int = 0) -> Optional[Worker]:
    """Most free KV pages first, then fewest requests."""
    return _rotate_best(workers, lambda w: (-(w.load.num_free_pages if w.load else 0), w.busy), turn)


def pick_prefill(workers: list[Worker], matched_blocks: dict[str, int], balance_threshold: int,
                 turn: int = 0) -> tuple[Optional[Worker], str, int]:
    """The worker owning the longest prefix, unless it has more than balance_threshold requests beyond the least
    loaded worker; else the least loaded. Returns (worker, reason, matched blocks)."""
    if not workers:
        return None, "none", 0
    least = _rotate_best(workers, lambda w: w.busy, turn)
    by_id = {w.info.worker_id: w for w in workers if w.info is not None}
    owners = sorted(((n, wid) for wid, n in matched_blocks.items() if wid in by_id), reverse=True)
    for n, wid in owners:
        w = by_id[wid]
        if w.busy - least.busy <= balance_threshold:
            return w, "prefix_hit", n
    return least, "load", 0
