"""benchmarks/pyspy_summary.py on a small collapsed-stack file in py-spy's raw format (`--threads --native`): the
per-thread shares, and `--gil`'s waits, told apart from a Python lock's wait and from work."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import pyspy_summary  # noqa: E402

ENGINE = "thread (11): decode-engine;Thread.run (threading.py:1010);LLMEngine.step (pdserve/engine.py:261)"
LOOP = "thread (12): MainThread;BaseEventLoop.run_forever (asyncio/base_events.py:641)"
RAW = "\n".join([
    # the engine thread: 6 samples of work, 3 waiting for the GIL after a torch op, 1 in a queue's wait (idle)
    f"{ENGINE};ModelRunner.pack_rows (pdserve/model_runner.py:182) 6",
    f"{ENGINE};NextNSpeculator.extend (pdserve/spec_decode.py:236);THPVariable_cat (libtorch_python.so);"
    "pybind11::gil_scoped_release::~gil_scoped_release (libtorch_python.so);pthread_cond_timedwait (libc.so.6) 2",
    f"{ENGINE};NextNSpeculator._verify_chained (pdserve/spec_decode.py:352);THPVariable_tolist (libtorch_python.so);"
    "pthread_cond_timedwait (libc.so.6);0x7f61 (libc.so.6) 1",
    "thread (11): decode-engine;Thread.run (threading.py:1010);EngineLoop._run_commands "
    "(pdserve/serving/engine_loop.py:57);PyThread_acquire_lock_timed (python3.12);pthread_cond_timedwait (libc.so.6) 1",
    # the event loop: 9 samples in epoll, 1 waiting for the GIL when epoll returned
    f"{LOOP};EpollSelector.select (selectors.py:468);epoll_wait (libc.so.6) 9",
    f"{LOOP};EpollSelector.select (selectors.py:468);pthread_cond_timedwait (libc.so.6) 1",
    "a line whose frame has a space and no count",
])


def test_gil_waits_per_thread_and_where(tmp_path, capsys):
    raw = tmp_path / "decode.raw"
    raw.write_text(RAW + "\n")
    samples, waits, where = pyspy_summary.gil_waits(str(raw), None)
    engine, loop = "thread (11): decode-engine", "thread (12): MainThread"
    assert samples == {engine: 10, loop: 10}
    assert waits == {engine: 3, loop: 1}  # the queue's wait is not the GIL's
    assert where["NextNSpeculator.extend (pdserve/spec_decode.py:236)"] == 2
    assert where["NextNSpeculator._verify_chained (pdserve/spec_decode.py:352)"] == 1
    # within a step: the engine's samples under LLMEngine.step only (the idle queue wait is outside it)
    samples, waits, _ = pyspy_summary.gil_waits(str(raw), "engine", within="LLMEngine.step")
    assert samples == {engine: 9} and waits == {engine: 3}
    assert pyspy_summary.main([str(raw), "--gil", "--thread", "engine", "--within", "LLMEngine.step"]) == 0
    out = capsys.readouterr().out
    assert "33.3%  of      9 samples  thread (11): decode-engine" in out and "66.7%  NextNSpeculator.extend" in out
    assert pyspy_summary.main([str(raw), "--gil", "--within", "NoSuchFrame"]) == 1


def test_shares_per_thread(tmp_path, capsys):
    raw = tmp_path / "decode.raw"
    raw.write_text(RAW + "\n")
    total, threads, inclusive, _ = pyspy_summary.parse(str(raw), None)
    assert total == 20 and threads["thread (11): decode-engine"] == 10
    assert inclusive["LLMEngine.step (pdserve/engine.py:261)"] == 9
    assert pyspy_summary.main([str(raw), "--thread", "MainThread"]) == 0
    assert "10 samples" in capsys.readouterr().out
