"""When a decode worker's engine hands its tokens over (DecodeEngine.step, its StepHooks.before_device_wait).

Without speculation the overlap scheduler already hands a step's tokens over while the GPU runs the next step. A
speculative round has no such overlap: its one device-to-host read is a plain wait. So a round's outputs are held
and handed over from the next round's wait (the event loop's work for them then runs behind the GPU's, not between
two rounds holding the GIL), and at once when no round follows. Every token still arrives, in order, and the greedy
tokens are the single-process engine's.
"""

from __future__ import annotations

import pytest

from pdserve.decode_service.server import DecodeWorker, DecodeWorkerConfig
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.serving.metrics import Metrics
from pdserve.serving.worker_common import WorkerIdentity
from pdserve.spec_decode import SpeculativeConfig

NEXTN = SpeculativeConfig("NEXTN", num_steps=3)
PROMPTS = ["def add(a, b):\n    return", "import os\nimport"]
LENGTHS = [9, 17]  # one request finishes while the other goes on: its last tokens are held by a round after it


def config(model_dir, speculative: SpeculativeConfig = SpeculativeConfig()) -> EngineConfig:
    return EngineConfig(str(model_dir), dtype="float32", cache=CacheConfig(page_size=4, num_pages=256),
                        speculative=speculative)


class RecordingOutbox:
    """Stands for the event loop the engine hands its outputs to: records each hand-off, and whether a round's
    device wait made it."""

    def __init__(self):
        self.in_wait = False
        self.handoffs: list[tuple[bool, list]] = []  # (from a device wait, outputs)

    def deliver(self, items) -> None:
        self.handoffs.append((self.in_wait, [out for _, out in items]))


@pytest.fixture
def worker(cleanup):
    """worker(model_dir, speculative) -> a DecodeWorker (not started) whose engine hands its outputs to a
    RecordingOutbox (`worker.outbox`)."""
    def make(model_dir, speculative: SpeculativeConfig = SpeculativeConfig()) -> DecodeWorker:
        w = DecodeWorker(DecodeWorkerConfig(config(model_dir, speculative), warmup=False),
                         WorkerIdentity("decode-test", "decode", "127.0.0.1:0"), Metrics.create("decode"))
        cleanup(w.receiver)
        w.outbox = RecordingOutbox()
        w.engine.deliver = w.outbox.deliver
        return w
    return make


def test_a_speculating_decode_worker_hands_a_rounds_tokens_over_during_the_next_rounds_device_wait(
        trained_model_dir, worker):
    engine = LLMEngine(config(trained_model_dir))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in LENGTHS]
    want = {i: o.output_ids for i, o in enumerate(engine.generate([engine.encode(p) for p in PROMPTS], params))}

    worker = worker(trained_model_dir, NEXTN)
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
    worker.engine.send_unsent()  # what the engine loop calls when it finds no work: nothing may be left by then
    assert not worker.engine._unsent

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


def test_without_speculation_a_step_hands_its_tokens_over_at_once(tiny_v3_dir, worker):
    """The overlap scheduler's steps already overlap the hand-off with the GPU: nothing is held."""
    worker = worker(tiny_v3_dir)
    assert worker.core.speculator is None and worker.core.hooks is worker.engine
    loop = worker.outbox
    worker.core.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=6, ignore_eos=True))
    steps = 0
    while worker.engine.has_work:
        worker._step()
        steps += 1
        assert not worker.engine._unsent
    assert sum(len(o.new_token_ids) for _, outs in loop.handoffs for o in outs) == 6 and len(loop.handoffs) <= steps
