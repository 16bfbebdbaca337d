"""An idle process stops on SIGTERM in under a second, cleanly (real processes): a decode and a prefill worker with
the router's open calls on them, then the router. Exit status 0, and nothing in the log that looks like a crash (an
asyncio CancelledError traceback from grpc's ended calls was printed on every stop)."""

from __future__ import annotations

import signal
import time

import pytest

from pdserve.sampling import SamplingParams

from stack import Proc, generate, start_stack, wait_idle

pytestmark = pytest.mark.slow


def stop_timed(proc: Proc) -> float:
    t0 = time.monotonic()
    proc.popen.send_signal(signal.SIGTERM)
    status = proc.popen.wait(10)
    seconds = time.monotonic() - t0
    assert status == 0, f"{proc.role} exited {status}:\n{proc.log()}"
    assert "Traceback" not in proc.log(), proc.log()
    return seconds


def test_idle_processes_exit_on_sigterm_within_a_second(trained_model_dir, tmp_path):
    stack = start_stack(trained_model_dir, tmp_path)
    try:
        # The router's PrefillStream and DecodeStream calls are open on the workers: idle, but connected.
        assert len(generate(stack.router.address, [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=4,
                                                                                 ignore_eos=True)).output_ids) == 4
        for proc in stack.prefill + stack.decode:
            wait_idle(proc)
        times = {p.role: stop_timed(p) for p in (stack.decode[0], stack.prefill[0], stack.router)}
        print("SIGTERM to exit:", {role: f"{s:.2f} s" for role, s in times.items()})
        assert all(s < 1.0 for s in times.values()), times
    finally:
        stack.stop()
