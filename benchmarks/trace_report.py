"""Where requests' time goes between the stack's processes, from the timestamps PDSERVE_TRACE collects
(pdserve/common/trace.py): for every point a request passed, the median time since the router received it, and since
the point before it.

    PDSERVE_TRACE=/tmp/t pdserve up ...   # then drive it (pdserve bench), then stop it
    python benchmarks/trace_report.py /tmp/t [--json out.json]

Only requests that passed `router.recv` count (each request is timed from there); a point some requests skip (a
first token that ends the request never sends `router.prefill_answer` ahead) is reported over those that passed it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from collections import defaultdict


def load(folder: str) -> dict[str, dict[str, int]]:
    """{request id: {event: first time (ns)}} from every process's file."""
    requests: dict[str, dict[str, int]] = defaultdict(dict)
    for path in glob.glob(os.path.join(folder, "*.trace")):
        with open(path) as f:
            for line in f:
                parts = line.split(" ", 2)
                if len(parts) != 3:
                    continue  # a line cut by a killed process
                t, event, rid = int(parts[0]), parts[1], parts[2].rstrip("\n")
                if event not in requests[rid] or t < requests[rid][event]:
                    requests[rid][event] = t
    return requests


def report(requests: dict[str, dict[str, int]]) -> list[dict]:
    """One row per event, in order of its median offset: offset from router.recv and gap from the row before, ms."""
    offsets: dict[str, list[float]] = defaultdict(list)
    for events in requests.values():
        start = events.get("router.recv")
        if start is None:
            continue
        for event, t in events.items():
            offsets[event].append((t - start) / 1e6)
    rows = sorted(({"event": e, "requests": len(v), "median_ms": statistics.median(v)} for e, v in offsets.items()),
                  key=lambda r: r["median_ms"])
    previous = 0.0
    for row in rows:
        row["gap_ms"] = row["median_ms"] - previous
        previous = row["median_ms"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="the PDSERVE_TRACE folder")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    requests = load(args.folder)
    rows = report(requests)
    timed = sum(1 for e in requests.values() if "router.recv" in e)
    print(f"{timed} requests timed from router.recv ({len(requests)} ids seen) in {args.folder}")
    print(f"{'point':28s} {'requests':>8s} {'since router.recv':>18s} {'since the point before':>24s}")
    for r in rows:
        print(f"{r['event']:28s} {r['requests']:8d} {r['median_ms']:15.2f} ms {r['gap_ms']:21.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"folder": args.folder, "requests": timed, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
