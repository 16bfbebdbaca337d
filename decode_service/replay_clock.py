"""The GPU time of CUDA graph replays, measured without ever waiting for the GPU: what a decode worker's GPU-share
pacing (pacing.py) reads.

The host cannot see a step's GPU cost: its wall time on the host is its launch (a small model's steps are host-bound)
or, under overlap scheduling, mostly the previous step. Each replay is bracketed by a pair of CUDA events instead,
read once the GPU has passed them. The clock reaches the replays through the graph runners' generic replay hook
(`DecodeGraphRunner.replay_hook`, installed by `time_replays`): the engine knows nothing of it.
"""

from __future__ import annotations

import bisect
import collections
from typing import Hashable, Optional

import torch

from pdserve.cuda_streams import current_stream
from pdserve.engine import LLMEngine


class ReplayClock:
    """Per captured graph (a family: which runner and kind of graph; and its rows, the bucket), the fastest replay
    seen, in seconds.

    The fastest, not the latest: on a GPU time-sliced with another process a replay's two events also span the other
    process's kernels that ran between them, so only the fastest replays show the graph's own cost. A key's first
    replays may read high (a cold L2, clocks ramping up); they are superseded by the first fast one.

    Engine thread only (it records on the current stream).
    """

    def __init__(self) -> None:
        self.fastest_s: dict[tuple[Hashable, int], float] = {}  # (family, rows) -> seconds
        self._timed_rows: dict[Hashable, list[int]] = {}  # family -> the rows of its timed graphs, ascending
        self._in_flight: collections.deque = collections.deque()  # ((family, rows), start, end) in stream order
        self._spare: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._launched: list[tuple[Hashable, int]] = []
        self._completed: list[tuple[float, float]] = []  # (seconds, its graph's fastest) of replays completed
        self._device_index: Optional[int] = None  # known at the first replay

    def replay(self, family: Hashable, rows: int, graph: torch.cuda.CUDAGraph) -> None:
        """graph.replay(), timed; the graph is family's with `rows` rows."""
        self._collect()
        start, end = self._spare.pop() if self._spare else (torch.cuda.Event(enable_timing=True),
                                                             torch.cuda.Event(enable_timing=True))
        if self._device_index is None:  # the engine thread's device (its graphs replay on its current stream)
            self._device_index = torch.cuda.current_device()
        stream = current_stream(self._device_index)
        start.record(stream)
        graph.replay()
        end.record(stream)
        self._in_flight.append(((family, rows), start, end))
        self._launched.append((family, rows))

    def take_launched(self, scale: float = 1.0) -> float:
        """The GPU seconds of the replays launched since the last call, each at its graph's fastest known time (none
        known yet: 0). scale > 1: had each had `scale` times its rows, i.e. the same family's smallest timed graph
        with at least that many (its largest timed one when none has as many)."""
        self._collect()
        seconds = sum(self._fastest_with(family, rows * scale) for family, rows in self._launched)
        self._launched.clear()
        return seconds

    def take_completed(self) -> list[tuple[float, float]]:
        """(seconds, its graph's fastest seconds) of each replay completed since the last call. Above the fastest:
        another process's kernels ran between its two events (a GPU shared with a busy prefill worker), or the
        GPU reached the start event before the host had submitted the graph (a small graph on an idle stream)."""
        self._collect()
        completed, self._completed = self._completed, []
        return completed

    def _fastest_with(self, family: Hashable, rows: float) -> float:
        # (Per launched replay, i.e. several times a step: a sorted list kept as graphs get timed, not a sort here.)
        timed = self._timed_rows.get(family)
        if not timed:
            return 0.0
        i = bisect.bisect_left(timed, rows)
        return self.fastest_s[(family, timed[min(i, len(timed) - 1)])]

    def _collect(self) -> None:
        # NOTE: Event.query() does not block; events complete in stream order, so the first pending one stops it.
        while self._in_flight and self._in_flight[0][2].query():
            key, start, end = self._in_flight.popleft()
            seconds = start.elapsed_time(end) / 1e3
            if key not in self.fastest_s:
                bisect.insort(self._timed_rows.setdefault(key[0], []), key[1])
            if seconds < self.fastest_s.get(key, float("inf")):
                self.fastest_s[key] = seconds
            self._completed.append((seconds, self.fastest_s[key]))
            self._spare.append((start, end))


def time_replays(core: LLMEngine) -> Optional[ReplayClock]:
    """A clock timing every CUDA graph replay of `core` (its decode graphs and, speculating, its NextN graphs), or
    None without graphs (a CPU engine, or graphs off): its steps then have no known GPU time."""
    runners = [r for r in (core.runner.graphs, core.runner.mtp_graphs) if r is not None]
    if not runners:
        return None
    clock = ReplayClock()
    for runner in runners:
        runner.replay_hook = clock.replay
    return clock
