"""Decode-step pacing (`pdserve decode --min-step-interval-ms / --gpu-share-while-prefilling`, DecodeWorker._hold,
decode_service/pacing.py): while prompts bound for a decode worker are still being prefilled, its steps start at most
every interval, and no sooner than their GPU time / share after the last; with none on their way they run back to
back; commands (KV arriving, aborts) are never held; tokens stay the single-process engine's."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_service.pacing import REPLAY_WINDOW, StepPacer
from decode_service.replay_clock import ReplayClock
from golden import GREEDY, PROMPTS
from pdserve.serving.engine_loop import EngineLoop
from stack import hooks_env, metric, start_stack
from test_first_token import timed_chunks


def test_the_pacer_waits_for_the_later_of_the_interval_and_the_gpu_time_over_the_share():
    pacer = StepPacer(min_interval_s=0.020, gpu_share=1 / 3)
    pacer.replays_completed([(0.009, 0.006), (0.011, 0.006)])  # contended: the other process's kernels ran inside
    assert pacer.contended
    assert pacer.enabled and pacer.wait(now=5.0) < 0  # no step yet: at once
    pacer.started(10.0)
    pacer.launched(0.009)  # a 9 ms step at a third of the GPU: 27 ms from its start, later than the 20 ms interval
    assert pacer.wait(10.0) == pytest.approx(0.027)
    assert pacer.wait(10.020) == pytest.approx(0.007)
    assert pacer.wait(10.030) < 0
    pacer.started(11.0)
    pacer.launched(0.003)  # a 3 ms step: 9 ms by the share, so the 20 ms interval decides
    assert pacer.wait(11.0) == pytest.approx(0.020)
    pacer.started(12.0)
    pacer.launched(None)  # GPU time unknown (an eager step, a graph not timed yet): only the interval
    assert pacer.wait(12.0) == pytest.approx(0.020)


def test_the_gpu_share_holds_nothing_back_while_the_gpu_is_not_contended():
    """Replays that run as fast as they ever did: the other process leaves the GPU idle (a host-bound prefill), so
    a held step would give it nothing. The fixed interval still applies; the window follows the recent replays."""
    pacer = StepPacer(gpu_share=1 / 3)
    pacer.started(1.0)
    pacer.launched(0.009)
    assert not pacer.contended and pacer.wait(1.0) <= 0  # no replay timed yet
    # As fast as ever, give or take a small graph's launch on an idle stream (0.2 ms on a 0.2 ms replay: 2x).
    pacer.replays_completed([(0.0062, 0.006), (0.0004, 0.0002), (0.0061, 0.006)] * 10)
    assert not pacer.contended and pacer.wait(1.0) <= 0
    pacer.replays_completed([(0.011, 0.006)] * 20)  # the prefill got busy: the last 32 replays 3.2 ms over on average
    assert pacer.contended and pacer.wait(1.0) == pytest.approx(0.027)
    pacer.replays_completed([(0.006, 0.006)] * REPLAY_WINDOW)  # and idle again
    assert not pacer.contended and pacer.wait(1.0) <= 0
    pacer.replays_completed([(0.0069, 0.006)] * REPLAY_WINDOW)  # 0.9 ms over, but 15%: clocks down from boost
    assert not pacer.contended and pacer.wait(1.0) <= 0
    fixed = StepPacer(min_interval_s=0.02, gpu_share=1 / 3)
    fixed.started(1.0)
    fixed.launched(0.009)
    assert fixed.wait(1.0) == pytest.approx(0.02)  # an interval asked for is kept, contended or not


def test_at_a_share_of_one_the_gpu_time_holds_nothing_back():
    """Under overlap scheduling the next step is launched while the last still runs: a share of 1 must not wait."""
    pacer = StepPacer(gpu_share=1.0)
    assert not pacer.enabled
    pacer.started(1.0)
    pacer.launched(0.007)
    assert pacer.wait(1.001) <= 0
    assert StepPacer(min_interval_s=0.0, gpu_share=0.5).enabled


@pytest.mark.parametrize("kwargs", [{"gpu_share": 0.0}, {"gpu_share": 1.5}, {"gpu_share": float("nan")},
                                    {"min_interval_s": -1.0}])
def test_the_pacer_refuses_settings_that_mean_nothing(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        StepPacer(**kwargs)


def test_a_held_engine_loop_spaces_its_steps_and_still_runs_commands_at_once():
    steps: list[float] = []
    holding = threading.Event()
    holding.set()
    interval = 0.08

    def hold() -> float:
        return steps[-1] + interval - time.monotonic() if steps and holding.is_set() else 0.0

    loop = EngineLoop(lambda: steps.append(time.monotonic()), lambda: len(steps) < 6, hold=hold).start()
    try:
        sent = time.monotonic()
        assert loop.submit(lambda: "ran").result(timeout=5) == "ran"
        assert time.monotonic() - sent < interval / 2  # a command waits for no hold
        deadline = time.monotonic() + 5
        while len(steps) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        holding.clear()  # no more hold: the last steps come back to back
        while len(steps) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert len(steps) == 6
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert min(gaps[:2]) >= interval * 0.95, gaps
    assert gaps[-1] < interval / 2, gaps


class FakeEvent:
    def __init__(self, t: float):
        self.t = t

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.t - self.t) * 1e3


@pytest.mark.parametrize("scale, want_ms", [(1.0, 2 + 1 + 3), (1.5, 3 + 2 + 3), (0.25, 1 + 1 + 1)])
def test_the_replay_clock_charges_each_replay_at_the_smallest_timed_graph_with_the_rows_scaled(scale, want_ms):
    """ReplayClock.take_launched's look-up (a sorted list per family, kept as graphs get timed), without a GPU:
    replays of the 8-, 4- and 16-row graphs, each charged at the smallest timed graph with scale x its rows (the
    largest when none has as many)."""
    clock = ReplayClock()
    for rows, ms in ((8, 2.0), (4, 1.0), (16, 3.0)):
        clock._in_flight.append((("target", rows), FakeEvent(0.0), FakeEvent(ms / 1e3)))
        clock._launched.append(("target", rows))
    clock._in_flight.append((("target", 4), FakeEvent(0.0), FakeEvent(5e-3)))  # slower than its fastest: not kept
    clock._in_flight.append((("draft", 64), FakeEvent(0.0), FakeEvent(9e-3)))  # another family: not looked at
    assert clock.take_launched(scale) == pytest.approx(want_ms / 1e3)
    assert clock.fastest_s[("target", 4)] == pytest.approx(1e-3)


@dataclasses.dataclass
class AThenB:
    """Request A's tokens, its gaps while it decoded alone and while B was on its way, and B's tokens."""
    a_ids: list[int]
    b_ids: list[int]
    alone: list[float]  # seconds between A's chunks before B was sent
    waiting: list[float]  # ... while B's KV was held back (its first 0.3 s and last 0.1 s left out)


def a_then_b(stack, a_tokens: int, kv_delay_s: float, timeout_s: float = 60.0, alone_s: float = 0.5) -> AThenB:
    """Request A (PROMPTS[0], a_tokens greedy tokens) decodes alone about alone_s; then B (PROMPTS[2]) is reserved on
    the same decode worker, its KV held back kv_delay_s by the stack's test hook (which holds A's own KV back too).
    A must still be decoding 0.3 s after B was sent (`waiting` starts there): a_tokens at the worker's pace."""
    long = dataclasses.replace(GREEDY, max_new_tokens=a_tokens)  # still decoding when B's KV arrives
    with ThreadPoolExecutor(2) as pool:
        a_sent = time.monotonic()
        a = pool.submit(timed_chunks, stack.router.address, PROMPTS[0], long)
        time.sleep(kv_delay_s + alone_s)  # A's own KV is held back too; then it decodes alone a while
        b_sent = time.monotonic()
        b = pool.submit(timed_chunks, stack.router.address, PROMPTS[2], GREEDY)
        a_chunks, a_ids = a.result(timeout=timeout_s)
        _, b_ids = b.result(timeout=timeout_s)
    times = [a_sent + t for t, _, _ in a_chunks]  # (timed_chunks starts its clock just after a_sent)
    b_first_kv = b_sent + kv_delay_s  # B's KV arrives no earlier
    return AThenB(a_ids, b_ids, alone=[y - x for x, y in zip(times, times[1:]) if x > times[1] and y < b_sent],
                  waiting=[y - x for x, y in zip(times, times[1:]) if x > b_sent + 0.3 and y < b_first_kv - 0.1])


@pytest.mark.slow
def test_a_paced_decode_worker_spaces_its_steps_only_while_a_prompt_is_on_its_way(tiny_v3_dir, tmp_path, reference):
    """Request A decodes; request B is reserved on the same decode worker, its KV held back 2 s (the test hook for a
    slow transfer). While B is on its way A's tokens come at most every INTERVAL; before it, at once."""
    interval_s, kv_delay_s = 0.3, 2.0
    stack = start_stack(tiny_v3_dir, tmp_path, decode_args=["--min-step-interval-ms", str(interval_s * 1e3)],
                        decode_env=hooks_env(PDTEST_DECODE_SLOW_KV_ARRIVAL_S=kv_delay_s))
    outputs, _ = reference
    try:
        run = a_then_b(stack, 300, kv_delay_s)
        held_s = metric(stack.decode[0].metrics_port, "pdserve_decode_step_hold_seconds_total")
    finally:
        stack.stop()
    assert run.b_ids == outputs[2].output_ids
    want_a = outputs[0].output_ids
    assert run.a_ids[:len(want_a)] == want_a and len(run.a_ids) == 300
    assert run.alone and max(run.alone) < interval_s / 2, run.alone
    assert len(run.waiting) >= 2 and min(run.waiting) >= interval_s * 0.8, run.waiting
    # Most of B's 2 s on its way went to holding A's steps back, and the decode worker's metrics say so.
    assert kv_delay_s / 2 <= held_s <= kv_delay_s + 1.0, held_s
