"""The worker's engine loop after a failed step: it reports the failure and goes on serving when the device still
works, and ends the worker (exit status 1, one line saying why) when the failure broke the device, as a CUDA
illegal memory access does (every later step would fail the same way). Run in a child process, since the worker
ends with os._exit."""

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
def device_check():
    if broken:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\\nmore detail")
loop = EngineLoop(step, lambda: len(steps) < 5, on_error=errors.append, device_check=device_check).start()
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
    assert last == ("pdserve: engine-loop: the device can no longer run steps (CUDA error: an illegal memory access "
                    "was encountered); this worker stops (exit status 1) so that its requests go elsewhere"), last
