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
from concurrent.futures import ThreadPoolExecutor

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


def _signal_and_wait(proc, rank1: int, lines: list[str], sig) -> tuple[int, float, str]:
    """Send rank 1 `sig`; (the worker's exit status, seconds until it ended, everything it printed). Nothing outlives
    the test."""
    os.kill(rank1, sig)
    sent = time.monotonic()
    try:
        rest = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
        if not _gone(rank1):
            os.kill(rank1, signal.SIGKILL)
    return proc.returncode, time.monotonic() - sent, "".join(lines) + rest


def _kill_rank_0(tmp_path) -> bool:
    """SIGKILL the generate process (rank 0): whether its rank 1 was gone within 10 s."""
    proc, rank1, _ = _start(tmp_path)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while not _gone(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = _gone(rank1)
    if not gone:
        os.kill(rank1, signal.SIGKILL)
    return gone


# name -> what it runs: a killed rank 1 under plain TP and under DP attention, a hung (stopped) rank 1, a killed rank 0
FAULTS = {
    "tp": lambda tmp: _signal_and_wait(*_start(tmp), signal.SIGKILL),
    "dp-attention": lambda tmp: _signal_and_wait(*_start(tmp, "--dp-attention"), signal.SIGKILL),
    "hung": lambda tmp: _signal_and_wait(*_start(tmp, "--dp-attention", "--collective-timeout", "2"), signal.SIGSTOP),
    "rank-0-killed": _kill_rank_0,
}


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict:
    """Each fault of the tests below on a `generate --tp 2` of its own, all side by side (each process imports torch
    and loads the model before it decodes: seconds of one core each, so their start-ups overlap): name -> what its
    FAULTS entry returned."""
    def run(name):
        return FAULTS[name](tmp_path_factory.mktemp(f"tp-fault-{name}"))

    with ThreadPoolExecutor(len(FAULTS)) as pool:
        futures = {name: pool.submit(run, name) for name in FAULTS}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("fault", ["tp", "dp-attention"])
def test_a_killed_rank_ends_the_worker_with_its_name(faults, fault):
    """Under DP attention the one request runs on rank 0: rank 1, idle, is killed inside the step's collectives."""
    returncode, took, err = faults[fault]
    assert returncode == 1, err[-3000:]
    assert "tensor-parallel rank 1 of 2" in err and "was killed by SIGKILL" in err, err[-3000:]
    assert took < 10, f"the worker took {took:.1f}s to stop"
    print(f"stopped {took:.2f}s after rank 1 was killed: {err.strip().splitlines()[-1]}")


def test_a_hung_rank_ends_the_worker_within_the_collective_timeout(faults):
    """Rank 1 stopped (SIGSTOP: alive, its sockets open, so no collective fails at once): rank 0's next collective
    waits --collective-timeout, then the worker ends with exit 1 and says what happened."""
    returncode, took, err = faults["hung"]
    assert returncode == 1, err[-3000:]
    assert "RanksOutOfStep" in err and "collective timeout (2s, --collective-timeout)" in err, err[-3000:]
    assert took < 15, f"the worker took {took:.1f}s to stop"
    print(f"stopped {took:.2f}s after rank 1 hung: {err.strip().splitlines()[-1]}")


def test_rank_1_ends_when_rank_0_is_killed(faults):
    assert faults["rank-0-killed"], "rank 1 outlived rank 0"


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
