"""A tensor-parallel `pdserve generate --tp 2` (real processes, plain TP and DP attention) whose rank dies mid-run
ends, within seconds and without hanging in a collective, with a message naming the rank; a rank that hangs
(stopped) ends it once a collective waits past --collective-timeout; when rank 0 dies the other rank ends by itself.
And the flags' user errors: one line, exit 2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pdserve import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG_RUN = ["--tp", "2", "--dtype", "float32", "--input-ids", "5,6,7,8", "--max-new-tokens", "1900", "--ignore-eos"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _start(tmp_path, *extra):
    """The running generate process and its rank 1's pid, once the model is ready and decoding."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "generate", *LONG_RUN, *extra], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, rank1 = [], None
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"tensor-parallel rank 1 of 2 started \(pid (\d+)", line)
        rank1 = int(m.group(1)) if m else rank1
        if "model ready" in line:
            break
    assert rank1 is not None and proc.poll() is None, "".join(lines)
    time.sleep(0.5)  # decoding: 1900 tokens take far longer than this
    assert proc.poll() is None, "".join(lines)
    return proc, rank1, lines


def _signal_and_wait(proc, rank1: int, lines: list[str], sig) -> tuple[float, str]:
    """Send rank 1 `sig`; (seconds until the worker ended, everything it printed). Nothing outlives the test."""
    os.kill(rank1, sig)
    sent = time.monotonic()
    try:
        rest = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
        if not _gone(rank1):
            os.kill(rank1, signal.SIGKILL)
    return time.monotonic() - sent, "".join(lines) + rest


@pytest.mark.parametrize("extra", [(), ("--dp-attention",)], ids=["tp", "dp-attention"])
def test_a_killed_rank_ends_the_worker_with_its_name(tmp_path, extra):
    """Under DP attention the one request runs on rank 0: rank 1, idle, is killed inside the step's collectives."""
    proc, rank1, lines = _start(tmp_path, *extra)
    took, err = _signal_and_wait(proc, rank1, lines, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert "tensor-parallel rank 1 of 2" in err and "was killed by SIGKILL" in err, err[-3000:]
    assert took < 10, f"the worker took {took:.1f}s to stop"
    print(f"stopped {took:.2f}s after rank 1 was killed: {err.strip().splitlines()[-1]}")


def test_a_hung_rank_ends_the_worker_within_the_collective_timeout(tmp_path):
    """Rank 1 stopped (SIGSTOP: alive, its sockets open, so no collective fails at once): rank 0's next collective
    waits --collective-timeout, then the worker ends with exit 1 and says what happened."""
    proc, rank1, lines = _start(tmp_path, "--dp-attention", "--collective-timeout", "2")
    took, err = _signal_and_wait(proc, rank1, lines, signal.SIGSTOP)
    assert proc.returncode == 1, err[-3000:]
    assert "RanksOutOfStep" in err and "collective timeout (2s, --collective-timeout)" in err, err[-3000:]
    assert took < 15, f"the worker took {took:.1f}s to stop"
    print(f"stopped {took:.2f}s after rank 1 hung: {err.strip().splitlines()[-1]}")


def test_rank_1_ends_when_rank_0_is_killed(tmp_path):
    proc, rank1, _ = _start(tmp_path)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while not _gone(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(rank1), "rank 1 outlived rank 0"


@pytest.mark.parametrize("argv, message", [
    (["generate", "--tp", "3", "--input-ids", "1,2", "--device", "cpu"],
     "--tp 3 does not divide num_attention_heads=4 of tiny-trained"),
    (["generate", "--tp", "0", "--input-ids", "1,2", "--device", "cpu"],
     "--tp 0: the tensor-parallel size must be at least 1"),
    (["generate", "--tp", "2", "--ep", "4", "--input-ids", "1,2", "--device", "cpu"],
     "--ep 4: expert parallelism splits the routed experts over the --tp ranks; give --ep 2 (or 1)"),
    (["decode", "--tp", "3", "--device", "cpu", "--port", "0", "--metrics-port", "0"],
     "--tp 3 does not divide num_attention_heads=4 of tiny-trained"),
    (["generate", "--dp-attention", "--input-ids", "1,2", "--device", "cpu"],
     "--dp-attention spreads requests over the --tp ranks; give --tp 2 or more"),
    (["prefill", "--tp", "2", "--dp-attention", "--device", "cpu", "--port", "0", "--metrics-port", "0"],
     "--dp-attention: for decode workers"),
    (["generate", "--tp", "2", "--collective-timeout", "0", "--input-ids", "1,2", "--device", "cpu"],
     "--collective-timeout 0: must be a positive number of seconds"),
])
def test_tp_user_errors_are_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
