"""Publishes which prefix blocks this prefill worker holds to a shared ownership store (Redis), off the engine
thread: a Redis outage must never stall prefill, only make routing fall back to load."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Optional

log = logging.getLogger(__name__)


class OwnershipPublisher:
    def __init__(self, store, worker_id: str, metrics=None, max_queue: int = 10000):
        self.store, self.worker_id, self.metrics = store, worker_id, metrics
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="ownership-publisher", daemon=True)
        self._failing = False

    def start(self) -> "OwnershipPublisher":
        self._thread.start()
        return self

    # Same interface as an OwnershipStore's writes; the worker id argument is ours anyway.
    def record(self, worker_id: str, hashes: list[bytes]) -> None:
        self._put(("record", list(hashes)))

    def remove(self, worker_id: str, hashes: list[bytes]) -> None:
        if hashes:
            self._put(("remove", list(hashes)))

    def _put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:  # Redis has been away a long time: ownership is advisory, drop rather than grow
            pass

    def stop(self, timeout: float = 2.0) -> None:
        self._put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        from pdserve.cluster.ownership import OwnershipUnavailable

        while True:
            item: Optional[tuple] = self._queue.get()
            if item is None:
                return
            op, hashes = item
            try:
                getattr(self.store, op)(self.worker_id, hashes)
                if self._failing:
                    log.info("ownership store reachable again")
                self._failing = False
            except OwnershipUnavailable as e:
                if not self._failing:
                    log.warning("ownership store unreachable, routing falls back to load: %s", e)
                self._failing = True
                if self.metrics is not None:
                    self.metrics.count(self.metrics.redis_errors)
