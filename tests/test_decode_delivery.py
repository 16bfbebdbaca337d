"""When a decode worker's engine side hands its tokens over (DecodeEngineSide._step, StepHooks.before_device_wait).

Without speculation the overlap scheduler already hands a step's tokens over while the GPU runs the next step. A
speculative round has no such overlap: its one device-to-host read is a plain wait. So a round's outputs are held
and handed over from the next round's wait (the event loop's work for them then runs behind the GPU's, not between
two rounds holding the GIL), and at once when no round follows. Every token still arrives, in order, and the greedy
tokens are the single-process engine's.
"""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine, StepHooks
from pdserve.gpu_clock import ReplayClock
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.serving.metrics import Metrics
from pdserve.spec_decode import SpeculativeConfig

from decode_service.engine_side import DecodeEngineSide
from decode_service.server import DecodeWorkerConfig

NEXTN = SpeculativeConfig("NEXTN", num_steps=3)
PROMPTS = ["def add(a, b):\n    return", "import os\nimport"]
LENGTHS = [9, 17]  # one request finishes while the other goes on: its last tokens are held by a round after it


def config(model_dir, speculative: SpeculativeConfig = SpeculativeConfig()) -> EngineConfig:
    return EngineConfig(str(model_dir), dtype="float32", cache=CacheConfig(page_size=4, num_pages=256),
                        speculative=speculative)


class RecordingOutbox:
    """Stands for the side's outbox: records each hand-off, and whether a round's device wait made it."""

    def __init__(self):
        self.in_wait = False
        self.handoffs: list[tuple[bool, list]] = []  # (from a device wait, outputs)

    def deliver(self, items) -> None:
        self.handoffs.append((self.in_wait, [out for _, out in items]))

    def flush(self) -> None:
        pass


def side(model_dir, speculative: SpeculativeConfig = SpeculativeConfig()) -> DecodeEngineSide:
    s = DecodeEngineSide(DecodeWorkerConfig(config(model_dir, speculative), warmup=False), Metrics.create("decode"))
    s.outbox = RecordingOutbox()
    return s


def test_a_speculating_decode_worker_hands_a_rounds_tokens_over_during_the_next_rounds_device_wait(
        trained_model_dir):
    engine = LLMEngine(config(trained_model_dir))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in LENGTHS]
    want = {i: o.output_ids for i, o in enumerate(engine.generate([engine.encode(p) for p in PROMPTS], params))}

    worker = side(trained_model_dir, NEXTN)
    loop = worker.outbox
    hooks, send = worker.core.hooks, worker.core.hooks.before_device_wait

    def waiting() -> None:  # the round's read is about to block: what the worker sends now runs behind the GPU
        loop.in_wait = True
        send()
        loop.in_wait = False

    hooks.before_device_wait = waiting
    ids = {worker.core.add_request(worker.core.encode(p), sp): i for i, (p, sp) in enumerate(zip(PROMPTS, params))}
    while worker.engine.has_work:
        worker._step()
    worker._idle()  # what the engine loop calls when it finds no work: nothing may be left by then
    assert not worker._unsent

    got: dict[int, list[int]] = {i: [] for i in want}
    for _, outputs in loop.handoffs:
        for out in outputs:
            got[ids[out.request_id]] += out.new_token_ids
    assert got == want  # every token, in order, the engine's
    # Every round but the first (the prompts' own step) and the last (nothing follows it) sent from a device wait;
    # the request that finished first had its last tokens held by a round of the other one.
    assert [w for w, _ in loop.handoffs[1:-1]] == [True] * (len(loop.handoffs) - 2) and len(loop.handoffs) > 4
    assert not loop.handoffs[-1][0] and loop.handoffs[-1][1][-1].finished
    first_done = next(k for k, (_, outs) in enumerate(loop.handoffs) if any(o.finished for o in outs))
    assert loop.handoffs[first_done][0]


def test_without_speculation_a_step_hands_its_tokens_over_at_once(tiny_v3_dir):
    """The overlap scheduler's steps already overlap the hand-off with the GPU: nothing is held."""
    worker = side(tiny_v3_dir)
    assert type(worker.core.hooks) is StepHooks
    loop = worker.outbox
    worker.core.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=6, ignore_eos=True))
    steps = 0
    while worker.engine.has_work:
        worker._step()
        steps += 1
        assert not worker._unsent
    assert sum(len(o.new_token_ids) for _, outs in loop.handoffs for o in outs) == 6 and len(loop.handoffs) <= steps


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
