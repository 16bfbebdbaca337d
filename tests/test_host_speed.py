"""benchmarks/host_speed.py: how fast each CPU runs Python (the spread bench_serving.py records beside its ratios)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import host_speed
from stack import REPO


def test_every_allowed_cpu_is_timed_and_the_threads_affinity_is_put_back():
    before = os.sched_getaffinity(0)
    times = host_speed.per_cpu_loop_ms(rounds=2, reps=1, iterations=20_000)
    assert os.sched_getaffinity(0) == before
    assert sorted(times) == sorted(before)
    assert all(len(v) == 2 and all(ms > 0 for ms in v) for v in times.values())


def test_the_summary_names_the_cpus_over_the_slow_threshold():
    s = host_speed.summary({0: [7.0, 7.2], 1: [6.5, 6.6], 2: [13.9, 14.1], 3: [8.4, 8.6]})
    assert (s["cpus"], s["fastest_ms"], s["slowest_ms"]) == (4, 6.55, 14.0)
    assert s["slow_cpus"] == [2]  # 14.0 > 1.3 x 6.55; 8.5 is not
    assert host_speed.describe(s) == ("pure-Python loop per CPU 6.55-14.00 ms (median 7.80), 1 of 4 CPUs over 1.3x "
                                      "the fastest")


def test_the_command_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, "benchmarks/host_speed.py", "--rounds", "1", "--reps", "1", "--json",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "pure-Python loop per CPU" in proc.stdout and "round  1 ms" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"times_ms", "summary"} and data["summary"]["cpus"] == len(os.sched_getaffinity(0))
    bad = subprocess.run([sys.executable, "benchmarks/host_speed.py", "--rounds", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rounds and --reps must be >= 1" in bad.stderr
