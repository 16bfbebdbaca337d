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


@dataclass(frozen=True)
class HealthConfig:
    """When the router takes a worker out of routing, and how long a request waits for one to be back.

    A worker is out at once when a check is refused (connection refused, draining, wrong token): its streams end by
    themselves if it is dead, and finish if it drains. It is out after `misses` consecutive checks that took longer
    than `check_timeout_s` (one slow check is not enough), or, for a decode worker, when requests of ours are
    decoding on it and none has received anything for `progress_s`; then its requests in flight end at once with
    UNAVAILABLE (retried elsewhere when no token was sent yet). It rejoins at its next answered check. A request
    that finds no healthy worker of a role waits up to `wait_for_worker_s` (within its deadline) for one before
    UNAVAILABLE."""

    interval_s: float = 1.0  # between checks (GetLoad, which runs on the worker's engine thread)
    check_timeout_s: float = 1.0
    misses: int = 2
    progress_s: float = 5.0
    wait_for_worker_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "check_timeout_s", "progress_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HealthConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.misses < 1:
            raise ValueError(f"--health-check-misses must be >= 1, got {self.misses}")
        if self.wait_for_worker_s < 0:
            raise ValueError(f"--wait-for-worker must be >= 0, got {self.wait_for_worker_s}")

    @property
    def frozen_detect_s(self) -> float:
        """The longest a worker that stopped answering stays in routing."""
        return self.misses * (self.interval_s + self.check_timeout_s)


class WorkerDown(Exception):
    """A worker this request uses was taken out of routing while the request waited on it."""

    def __init__(self, worker: "Worker"):
        super().__init__(f"{worker.role} worker {worker.address} stopped responding ({worker.down_reason})")
        self.worker = worker


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
    misses: int = 0  # consecutive checks that timed out
    down_reason: str = ""
    decoding: int = 0  # requests of ours that have received tokens from it and are not finished
    last_message: float = field(default_factory=time.monotonic)  # anything streamed to one of our requests
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while out of routing after being in it
    polling: bool = False
    warmed_with: set[str] = field(default_factory=set)  # partners whose KV path a warm-up went through (warm_pairs)

    @property
    def layout(self) -> Optional[KVLayout]:
        return layout_from_proto(self.info.layout) if self.info is not None else None

    @property
    def busy(self) -> int:
        """Requests in the worker right now, as well as the router knows."""
        polled = (self.load.num_running_requests + self.load.num_waiting_requests) if self.load else 0
        return max(polled, self.in_flight)


class WorkerPool:
    def __init__(self, static: dict[str, list[str]], discover=None, health: HealthConfig = HealthConfig(),
                 security: SecurityConfig = SecurityConfig(), on_down=None):
        """static: role -> addresses; discover(role) -> list of addresses (Redis registry) or None. Who is healthy:
        see HealthConfig. One that comes back at a known address (static, or registered again in Redis) rejoins at
        the next check. on_down(worker, reason) is called when a worker is taken out of routing (for a metric)."""
        self.workers: dict[str, Worker] = {}
        self._static, self._discover, self.health = static, discover, health
        self.refresh_s = health.interval_s
        self._on_down = on_down
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
            if not w.polling:
                asyncio.ensure_future(self._poll(w))

    async def wait_for(self, roles: tuple[str, ...], until: float) -> bool:
        """Wait until every role has a healthy worker, or the monotonic time `until`; True if they have."""
        while not all(self.of_role(r) for r in roles):
            if time.monotonic() >= until:
                return False
            await asyncio.sleep(0.05)
        return True

    def mark_down(self, w: Worker, kind: str, detail: str) -> None:
        """Out of routing. kind: refused, missed_checks or stalled (a metric label); detail: for the log and the
        requests' status. A frozen or stalled worker's requests are told (Worker.down) and end at once; a refused
        check leaves them be: a dead worker's streams fail by themselves, a draining one's finish."""
        if w.healthy:
            log.warning("%s worker %s is out of routing: %s", w.role, w.address, detail)
            w.down_reason = detail
            if kind != "refused":
                w.down.set()
            if self._on_down is not None:
                self._on_down(w, kind)
        w.healthy = False
        w.info = None  # it may come back as a different process
        w.warmed_with.clear()  # (that process's pairs are cold)

    def check_progress(self, now: Optional[float] = None) -> None:
        """A decode worker whose decoding requests (ours) have received nothing for progress_s is stalled."""
        now = time.monotonic() if now is None else now
        for w in list(self.workers.values()):
            if w.healthy and w.decoding > 0 and now - w.last_message > self.health.progress_s:
                self.mark_down(w, "stalled",
                               f"no token for {now - w.last_message:.1f} s on {w.decoding} decoding requests")

    def seen(self, w: Worker) -> None:
        """A message from w reached one of our requests."""
        w.last_message = time.monotonic()

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
                self.check_progress()
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
        if w.polling:  # one check at a time per worker, so that one slow check counts as one miss
            return
        w.polling = True
        timeout = self.health.check_timeout_s
        try:
            if w.info is None:
                w.info = await w.stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=timeout,
                                                    metadata=self.metadata)
            w.load = await w.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # slow or frozen: down only after `misses` in a row
                w.misses += 1
                if w.misses >= self.health.misses or not w.healthy:
                    self.mark_down(w, "missed_checks", f"{w.misses} health checks in a row took over {timeout:g} s")
            else:  # refused, draining, or refusing our token: out at once
                self.mark_down(w, "refused", f"health check failed: {e.code().name}")
            return
        finally:
            w.polling = False
        w.misses = 0
        if not w.healthy:
            log.info("%s worker %s is in routing", w.role, w.address)
            w.down.clear()
            w.last_message = time.monotonic()  # the stall clock starts again
        w.healthy, w.last_ok = True, time.monotonic()


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
