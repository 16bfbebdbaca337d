"""Where a process's wall time goes, from a py-spy raw (collapsed-stack) file: time per thread, then the functions
with the largest inclusive and self share of the samples.

    py-spy record -p PID -d 8 -r 250 -f raw --threads --nonblocking -o decode.raw
    python benchmarks/pyspy_summary.py decode.raw [--top 40] [--thread decode-engine]

Shares are of all samples of the process (each thread is sampled on its own), so a thread busy all the time and
another idle show as about half each; `--thread` restricts the counts to threads whose name contains the text.
"""

from __future__ import annotations

import argparse
import collections
import sys


def parse(path: str, thread: str | None) -> tuple[int, collections.Counter, collections.Counter, collections.Counter]:
    total, threads, inclusive, self_time = 0, collections.Counter(), collections.Counter(), collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue  # a frame name with a space in it broke the line: py-spy's raw format allows that
            frames = stack.split(";")
            if thread and thread not in frames[0]:
                continue
            total += n
            threads[frames[0]] += n
            for frame in set(frames[1:]):  # a recursive frame counts once per sample
                inclusive[frame] += n
            self_time[frames[-1]] += n
    return total, threads, inclusive, self_time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy record -f raw output")
    p.add_argument("--top", type=int, default=30, help="rows per table (default 30)")
    p.add_argument("--thread", default=None, help="only threads whose name contains this")
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
