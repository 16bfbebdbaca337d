"""When a decode worker's next step may start while prompts bound for it are still being prefilled.

On a GPU shared with the prefill worker the two processes time-share it. Back to back, the decode worker steps every
few ms at whatever batch it holds; on a MoE model each step reads (nearly) every expert's weights whatever the batch,
so a dozen rows cost almost what a full batch does, and the prompts wait. Spaced, each step carries more rows for
about the same cost, the prompts get the GPU between steps, and both the output rate and time to first token gain,
for a longer inter-token latency. (The engine alone makes the same trade: while it prefills a batch, its decoding
rows get one token per prefill chunk.) With no prompt on its way there is nothing to make room for, and the steps
run back to back; the caller asks only then.

Two limits, the later one wins (the second only while the GPU is contended, CONTENDED_*):
- min_interval_s: a step starts at most this often (a fixed interval, right for one model and GPU);
- gpu_share: a step's own GPU time is at most this share of the time until the next one starts, i.e. the next
  waits gpu_seconds / gpu_share after this one's start. It follows the model: a step three times as long waits
  three times as long. A small model whose prefill worker is host-bound leaves the GPU free most of the time: its
  replays run unstretched, and its steps are not held.
  The decode worker charges a step at the GPU time it will take once the prompts on their way have joined the batch
  (its graphs at (running + on their way) rows): those prompts are what the held-back time is for, and they arrive
  in bursts. Charged at its current batch instead, a worker that holds a few rows while 30 prompts wait steps every
  few ms at a small batch's cost, exactly the steps that pacing is there to spare (benchmarks/results, knobs).

DecodePacing holds all of it for a decode worker: the StepPacer, the replay clock it reads GPU time from
(replay_clock.py, installed through the graph runners' replay hook) and the metrics it records.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable, Optional

from .replay_clock import time_replays

# The share holds steps back only while the GPU is contended: while the decode worker's recent graph replays took at
# least CONTENDED_STRETCH times their fastest and CONTENDED_EXCESS_S more, on average. Their CUDA events then span
# the other process's kernels too (without MPS the GPU time-slices between processes). Held
# back on a GPU the prefill worker leaves idle (its forward host-bound, as the demo model's is), a step gives nothing
# to the prompts and costs inter-token latency. Both limits, because neither alone tells contention apart:
# - a small graph launched onto an idle stream reads long (the GPU passes its start event before the host has
#   submitted the graph), enough to pass the ratio on a tiny model's short replays;
# - a graph's first replays can be its fastest by far (presumably the clocks leaving their boost): later ones alone
#   read a little over them, far less than beside a busy process (tests/test_gpu_pacing.py checks the difference).
CONTENDED_STRETCH = 1.25
CONTENDED_EXCESS_S = 0.5e-3
REPLAY_WINDOW = 32  # replays


@dataclass
class StepPacer:
    min_interval_s: float = 0.0
    gpu_share: float = 1.0  # 1: no limit from the GPU time
    last_start: float = float("-inf")
    last_gpu_s: float = 0.0  # the GPU time of the last step's launched work (0 when unknown)
    replays: collections.deque = field(default_factory=lambda: collections.deque(maxlen=REPLAY_WINDOW))

    def __post_init__(self) -> None:
        if not self.min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0 (got {self.min_interval_s})")
        if not 0 < self.gpu_share <= 1:
            raise ValueError(f"gpu_share must be in (0, 1] (got {self.gpu_share})")

    @property
    def enabled(self) -> bool:
        return self.min_interval_s > 0 or self.gpu_share < 1

    def started(self, now: float) -> None:
        self.last_start = now

    def launched(self, gpu_s: Optional[float]) -> None:
        """The step that started last launched GPU work taking gpu_s seconds (None or 0: unknown, no wait)."""
        self.last_gpu_s = gpu_s or 0.0

    def replays_completed(self, replays: Iterable[tuple[float, float]]) -> None:
        """(seconds, fastest seconds) of completed graph replays (replay_clock.ReplayClock.take_completed)."""
        self.replays.extend(replays)

    @property
    def contended(self) -> bool:
        """Whether the GPU is busy with another process's work too, by the recent replays (CONTENDED_*)."""
        if not self.replays:
            return False
        seconds = sum(s for s, _ in self.replays)
        fastest = sum(f for _, f in self.replays)
        return (seconds >= CONTENDED_STRETCH * fastest
                and seconds - fastest >= CONTENDED_EXCESS_S * len(self.replays))

    def wait(self, now: float) -> float:
        """Seconds until the next step may start (<= 0: now)."""
        # (At a share of 1 no wait: under overlap scheduling the next step is launched while this one runs.)
        by_gpu = self.last_gpu_s / self.gpu_share if self.gpu_share < 1 and self.contended else 0.0
        spacing = max(self.min_interval_s, by_gpu)
        return self.last_start + spacing - now


class DecodePacing:
    """A decode worker's pacing, all of it: its StepPacer, the clock that times its engine's CUDA graph replays (for
    a GPU share; installed through the graph runners' replay hook), and what it records in the worker's metrics.
    The worker asks `hold()` before a step while prompts are on their way, and tells `step_started` and
    `step_launched` around each step."""

    def __init__(self, core, min_interval_s: float, gpu_share: float, metrics):
        self.pacer = StepPacer(min_interval_s, gpu_share)
        self.metrics = metrics
        # Without graphs (a CPU engine, or graphs off) steps have no known GPU time and a share holds nothing back.
        self.clock = time_replays(core) if gpu_share < 1 else None
        self._held_since: Optional[float] = None  # when the step to come was first held back

    @property
    def active(self) -> bool:
        """Whether a step can ever be held back: a fixed interval, or a share with graph replays to time (a CPU
        engine given a share, as `pdserve up` passes it everywhere, has none)."""
        return self.pacer.min_interval_s > 0 or self.clock is not None

    def hold(self, now: float) -> float:
        """Seconds the next step waits (<= 0: none)."""
        wait = self.pacer.wait(now)
        if wait > 0 and self._held_since is None:
            self._held_since = now
        return wait

    def step_started(self, now: float) -> None:
        self.pacer.started(now)
        if self._held_since is not None:
            self.metrics.count(self.metrics.step_hold_seconds, now - self._held_since)
            self._held_since = None

    def step_launched(self, rows: int, coming: int) -> None:
        """The step that started last ran `rows` rows; `coming` prompts are on their way. It is charged as the step
        it will be once they have joined (see the module's docstring)."""
        if self.clock is None:
            return
        self.pacer.launched(self.clock.take_launched(scale=(rows + coming) / max(rows, 1)))
        replays = self.clock.take_completed()
        self.pacer.replays_completed(replays)
        for seconds, fastest in replays:
            self.metrics.replay_stretch.observe(seconds / fastest)
