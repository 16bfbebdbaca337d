"""Where a process's wall time goes, from a py-spy raw (collapsed-stack) file: time per thread, then the functions
with the largest inclusive and self share of the samples.

    py-spy record -p PID -d 8 -r 250 -f raw --threads --nonblocking -o decode.raw
    python benchmarks/pyspy_summary.py decode.raw [--top 40] [--thread decode-engine]

Shares are of all samples of the process (each thread is sampled on its own), so a thread busy all the time and
another idle show as about half each; `--thread` restricts the counts to threads whose name contains the text.

`--gil`, for a profile taken with `py-spy record --native --idle`: how much of each thread's time it waited for the
GIL, and at which Python lines. A sample counts as a GIL wait when a native frame after its last Python frame is
`pthread_cond_timedwait`: CPython 3.12 waits for the GIL on a condition variable with a timeout (take_gil), while
a Python lock, queue or event waits in PyThread_acquire_lock_timed (not counted, whatever it calls), and a CUDA
synchronisation spins. A wait shown at
a blocking call's line is the GIL taken back after the call returned. (Native code of another library that waits
on a condition variable would count too.) A torch op releases the GIL and takes it back, so a busy engine thread
that shares its process with an event loop shows its waits spread over the ops of its step.

    py-spy record -p PID -d 8 -r 100 -f raw --threads --native --idle -o decode.raw
    python benchmarks/pyspy_summary.py decode.raw --gil [--thread decode-engine] [--within "step (pdserve/engine.py"]
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Iterator


def stacks(path: str, thread: str | None) -> Iterator[tuple[list[str], int]]:
    """(frames, samples) per line of the raw file, frames[0] the thread; only threads whose name contains `thread`."""
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue  # a frame name with a space in it broke the line: py-spy's raw format allows that
            frames = stack.split(";")
            if not thread or thread in frames[0]:
                yield frames, n


def parse(path: str, thread: str | None) -> tuple[int, collections.Counter, collections.Counter, collections.Counter]:
    total, threads, inclusive, self_time = 0, collections.Counter(), collections.Counter(), collections.Counter()
    for frames, n in stacks(path, thread):
        total += n
        threads[frames[0]] += n
        for frame in set(frames[1:]):  # a recursive frame counts once per sample
            inclusive[frame] += n
        self_time[frames[-1]] += n
    return total, threads, inclusive, self_time


GIL_WAIT = "pthread_cond_timedwait"
LOCK_WAIT = "PyThread_acquire_lock"  # a Python lock's own wait (whatever it waits on inside): not the GIL


def gil_waits(path: str, thread: str | None, within: str | None = None
              ) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """Per thread: samples and samples waiting for the GIL; and the Python frames the waits happened under.
    within: only samples with a frame containing this text (e.g. a step function)."""
    samples, waits, where = collections.Counter(), collections.Counter(), collections.Counter()
    for frames, n in stacks(path, thread):
        if within and not any(within in x for x in frames[1:]):
            continue
        samples[frames[0]] += n
        python = [i for i, x in enumerate(frames) if ".py:" in x]
        native_tail = frames[python[-1] + 1:] if python else frames[1:]
        if any(GIL_WAIT in x for x in native_tail) and not any(LOCK_WAIT in x for x in native_tail):
            waits[frames[0]] += n
            where[frames[python[-1]] if python else "(no Python frame)"] += n
    return samples, waits, where


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy record -f raw output")
    p.add_argument("--top", type=int, default=30, help="rows per table (default 30)")
    p.add_argument("--thread", default=None, help="only threads whose name contains this")
    p.add_argument("--gil", action="store_true",
                   help="time spent waiting for the GIL, per thread (needs a profile recorded with --native)")
    p.add_argument("--within", default=None, help="with --gil: only samples under a frame containing this")
    args = p.parse_args(argv)
    if args.gil:
        return print_gil_waits(args)
    total, threads, inclusive, self_time = parse(args.raw, args.thread)
    if not total:
        print(f"{args.raw}: no samples", file=sys.stderr)
        return 1
    print(f"{args.raw}: {total} samples")
    for title, counter in (("threads", threads), ("inclusive", inclusive), ("self", self_time)):
        print(f"--- {title}")
        for name, n in counter.most_common(args.top):
            print(f"{n / total:7.1%}  {name[:150]}")
    return 0


def print_gil_waits(args: argparse.Namespace) -> int:
    samples, waits, where = gil_waits(args.raw, args.thread, args.within)
    if not samples:
        print(f"{args.raw}: no samples" + (f" under {args.within}" if args.within else ""), file=sys.stderr)
        return 1
    print(f"{args.raw}: waiting for the GIL" + (f", samples under {args.within}" if args.within else ""))
    for name, n in samples.most_common():
        print(f"{waits[name] / n:7.1%}  of {n:6d} samples  {name[:100]}")
    total = sum(waits.values())
    if total:
        print("--- where (Python frame of the wait, share of the waits)")
        for frame, n in where.most_common(args.top):
            print(f"{n / total:7.1%}  {frame[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
