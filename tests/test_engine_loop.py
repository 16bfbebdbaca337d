"""The worker's engine loop after a failed step: it reports the failure and goes on serving when the engine can run
another step, and ends the worker (exit status 1, one line saying why) when it cannot (a CUDA illegal memory access
broke the device, a tensor-parallel rank died or hangs: every later step would fail the same way). Run in a child
process, since the worker ends with os._exit. And LLMEngine.cannot_go_on, which says which errors are such."""

from __future__ import annotations

import subprocess
import sys

from stack import REPO

CHILD = """
import sys, threading, time
from pdserve.serving.engine_loop import EngineLoop
broken = sys.argv[1] == "broken"
steps, errors = [], []
def step():
    steps.append(1)
    if len(steps) == 2:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
def fatal(error):
    return f"its GPU can no longer run steps: {error}" if broken else None
loop = EngineLoop(step, lambda: len(steps) < 5, on_error=errors.append, fatal=fatal).start()
deadline = time.monotonic() + 10
while len(steps) < 5 and time.monotonic() < deadline:
    time.sleep(0.01)
loop.stop()
print(f"steps {len(steps)} errors {len(errors)}")
"""


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, mode], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_failed_step_on_a_working_device_leaves_the_worker_serving():
    proc = _run("working")
    assert proc.returncode == 0 and "steps 5 errors 1" in proc.stdout, proc.stdout + proc.stderr
    assert "engine step failed" in proc.stderr


def test_a_step_that_broke_the_device_ends_the_worker():
    proc = _run("broken")
    assert proc.returncode == 1 and "steps" not in proc.stdout, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("pdserve: engine-loop: this worker cannot go on: its GPU can no longer run steps: CUDA error: an "
                    "illegal memory access was encountered. It stops (exit status 1) so that its requests go "
                    "elsewhere"), last


def test_the_engine_says_which_errors_end_it(trained_model_dir):
    """Ranks gone or out of step end it; on the CPU any other error leaves it running (no device to break)."""
    from pdserve.engine import EngineConfig, LLMEngine
    from pdserve.parallel.ranks import RankDied, RanksOutOfStep

    engine = LLMEngine(EngineConfig(str(trained_model_dir), dtype="float32"), progress=lambda _m: None)
    assert engine.cannot_go_on(RankDied("tensor-parallel rank 1 of 2 (pid 7, cpu) was killed by SIGKILL: ...")) \
        == "tensor-parallel rank 1 of 2 (pid 7, cpu) was killed by SIGKILL: ..."
    assert engine.cannot_go_on(RanksOutOfStep("a step of the 2 tensor-parallel ranks failed\nmore")) \
        == "a step of the 2 tensor-parallel ranks failed"
    assert engine.cannot_go_on(ValueError("a bad batch")) is None
