"""First tokens out before the KV hand-over, when nothing else waits for the prefill worker's engine.

The engine thread tells the event loop a prompt's first token as soon as it is sampled (PrefillEngine's
on_first_tokens), then hands the prompt's KV over: the gathers, the NextN layer's one-token forward, the aux record.
Both threads need the GIL, and the answer waited behind the hand-over's host work.

Measured on the CPU machine through the product (`bench_serving.py --device cpu --models demo --concurrency 1
--num-prompts 32 --demo-input-len 64 --demo-output-len 16` with `PDSERVE_TRACE`, then `trace_report.py`; three runs
each way, alternating), median ms from the prefill worker's sampling to the router sending the first token on:
with NextN 1.81 / 0.89 / 1.31 before, 0.71 / 0.76 / 0.88 with the wait; plain 1.07 / 1.03 / 0.95 before, 1.01 / 0.80 /
0.71 with it. The price: the KV reaches the decode worker 0.2-0.4 ms later (NextN 2.43 -> 2.80 ms after the
sampling, plain 0.87 -> 1.05), which only the second token feels.

On the H200 (demo model, c=1, traced, this wait against MAX_WAIT_S = 0 on fresh stacks alternating; tree ae82ae4;
benchmarks/results/README.md) it changed nothing measurable: sampling -> router's first token 1.37-1.64 ms median
with it, 1.19-1.67 without, KV and second token alike (why it helps on the CPU machine and not there is not known).

So the engine thread, before the hand-over, waits (at most `max_wait_s`) until the event loop has handed the answers
it was just told to gRPC, but only when no other prompt waits for the engine: under load the next step comes first.
"""

from __future__ import annotations

import threading

# Long enough for the event loop to build and hand over a few answers, short against any prefill step.
MAX_WAIT_S = 0.002


class AnswersOut:
    def __init__(self, max_wait_s: float = MAX_WAIT_S):
        self.max_wait_s = max_wait_s
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._all_sent = threading.Event()
        self._all_sent.set()

    def expect(self, request_id: str) -> None:
        """Engine thread, before the answer is handed to the event loop."""
        with self._lock:
            self._pending.add(request_id)
            self._all_sent.clear()

    def sent(self, request_id: str) -> None:
        """Event loop, once the answer is with gRPC (a request never expected is ignored)."""
        with self._lock:
            self._pending.discard(request_id)
            if not self._pending:
                self._all_sent.set()

    def wait(self) -> bool:
        """Engine thread: until every expected answer is sent, or max_wait_s; False on the timeout. Either way the
        next wait starts afresh (an answer that never comes, its call cancelled, holds up only this one)."""
        done = self._all_sent.wait(self.max_wait_s)
        with self._lock:
            self._pending.clear()
            self._all_sent.set()
        return done


__all__ = ["AnswersOut", "MAX_WAIT_S"]
