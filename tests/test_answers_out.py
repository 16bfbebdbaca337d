"""A prefill worker with nothing else to compute lets its event loop send the first tokens it was told before its
engine thread hands their KV over (prefill_service/answers_out.py); under load it does not wait."""

from __future__ import annotations

import asyncio
import threading
import time

from pdserve.prefill_service.answers_out import AnswersOut
from pdserve.prefill_service.server import PrefillServicer

from test_prefill_bind import bound_request, in_process_worker
from test_prefill_streaming import RecordingHandle


def test_a_wait_ends_when_every_expected_answer_is_sent_or_at_its_bound():
    answers = AnswersOut(max_wait_s=5.0)
    answers.expect("a")
    answers.expect("b")
    threading.Timer(0.05, answers.sent, ["a"]).start()
    threading.Timer(0.10, answers.sent, ["b"]).start()
    t0 = time.monotonic()
    assert answers.wait() and 0.09 < time.monotonic() - t0 < 2.0
    answers.sent("never expected")  # ignored
    assert answers.wait()  # nothing expected: at once

    short = AnswersOut(max_wait_s=0.05)
    short.expect("cancelled")  # its call ended: its answer never comes
    t0 = time.monotonic()
    assert not short.wait() and time.monotonic() - t0 >= 0.05
    t0 = time.monotonic()
    assert short.wait() and time.monotonic() - t0 < 0.04  # the next wait does not wait for it again


def test_an_idle_worker_sends_the_first_token_before_the_kv_and_a_busy_one_does_not_wait(tiny_v3_dir):
    worker = in_process_worker(tiny_v3_dir)
    worker.answers.max_wait_s = 5.0  # (here: the order is what is checked, not the bound)
    events: list[str] = []
    handle = RecordingHandle(events)
    handle.transport = "tcp"
    worker.sender.begin = lambda *args: handle
    sent = worker.answers.sent
    worker.answers.sent = lambda rid: (events.append(f"answer {rid} sent"), sent(rid))

    async def prefill() -> None:
        worker.start(asyncio.get_running_loop())
        await PrefillServicer(worker).Prefill(bound_request(worker), context=None)
        for _ in range(200):  # the hand-over goes on after the answer
            if "finish" in events:
                return
            await asyncio.sleep(0.01)

    try:
        asyncio.run(prefill())
    finally:
        worker.loop.stop()
    assert "answer r sent" in events and "finish" in events, events
    assert events.index("answer r sent") < events.index("finish"), events

    waits = []
    worker.answers.wait = lambda: waits.append("waited") or True
    worker.core.scheduler.waiting.append(object())  # another prompt waits for the engine: the step goes on
    try:
        worker._let_answers_out(["r"])
    finally:
        worker.core.scheduler.waiting.pop()
    assert waits == []
    worker._let_answers_out(["r"])
    assert waits == ["waited"]
