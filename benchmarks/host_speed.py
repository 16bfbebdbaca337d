"""How fast each CPU of this machine runs Python right now.

A host-bound engine follows the speed of the CPU its thread runs on: the demo model's prefill is mostly host work
(launches, Python), little GPU work. On a virtual machine the CPUs need not run at one speed, nor keep the same
speed from one second to the next. Two host-bound numbers from two processes (the stack's, the engine alone's) then differ by which CPUs they landed on.
`bench_serving.py` records this at its start and end, so a table carries the machine's spread beside its ratios.

    python benchmarks/host_speed.py [--rounds 3] [--json FILE]

Per CPU this process may run on: a fixed pure-Python loop (200k additions) timed with the calling thread pinned to
that CPU, the median of `--reps` runs; `--rounds` passes over every CPU, one after another. The thread's own CPU
affinity is put back afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

LOOP_ITERATIONS = 200_000
SLOW = 1.3  # a CPU whose loop takes this many times the fastest CPU's counts as slow


def loop_ms(iterations: int = LOOP_ITERATIONS) -> float:
    """Milliseconds of a fixed pure-Python loop on the calling thread."""
    t = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i
    return 1e3 * (time.perf_counter() - t)


def per_cpu_loop_ms(rounds: int = 1, reps: int = 3, iterations: int = LOOP_ITERATIONS) -> dict[int, list[float]]:
    """{cpu: [the median loop time of each round, ms]} for every CPU the calling thread may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    times: dict[int, list[float]] = {cpu: [] for cpu in allowed}
    try:
        for _ in range(rounds):
            for cpu in allowed:
                os.sched_setaffinity(0, {cpu})
                times[cpu].append(statistics.median(loop_ms(iterations) for _ in range(reps)))
    finally:
        os.sched_setaffinity(0, allowed)
    return times


def summary(times: dict[int, list[float]]) -> dict:
    """The spread over CPUs of their median loop times: fastest, median and slowest ms, and which CPUs are slow."""
    per_cpu = {cpu: statistics.median(v) for cpu, v in times.items()}
    fastest = min(per_cpu.values())
    return {"cpus": len(per_cpu), "fastest_ms": round(fastest, 3),
            "median_ms": round(statistics.median(per_cpu.values()), 3),
            "slowest_ms": round(max(per_cpu.values()), 3),
            "slow_cpus": sorted(cpu for cpu, ms in per_cpu.items() if ms > SLOW * fastest),
            "per_cpu_ms": {str(cpu): round(ms, 3) for cpu, ms in per_cpu.items()}}


def describe(s: dict) -> str:
    """One line: 'pure-Python loop per CPU A-B ms (median M), N of C CPUs over 1.3x the fastest'."""
    return (f"pure-Python loop per CPU {s['fastest_ms']:.2f}-{s['slowest_ms']:.2f} ms (median {s['median_ms']:.2f}), "
            f"{len(s['slow_cpus'])} of {s['cpus']} CPUs over {SLOW}x the fastest")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="passes over every CPU (default 3)")
    p.add_argument("--reps", type=int, default=3, help="loops per CPU and round; their median counts (default 3)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the times and the summary here")
    args = p.parse_args()
    if args.rounds < 1 or args.reps < 1:
        p.error("--rounds and --reps must be >= 1")
    times = per_cpu_loop_ms(args.rounds, args.reps)
    print(f"{'cpu':>4}  " + "  ".join(f"round {r + 1:>2} ms" for r in range(args.rounds)))
    for cpu, v in times.items():
        print(f"{cpu:>4}  " + "  ".join(f"{ms:11.2f}" for ms in v))
    s = summary(times)
    print(describe(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times_ms": {str(c): v for c, v in times.items()}, "summary": s}, f, indent=1)


if __name__ == "__main__":
    main()
