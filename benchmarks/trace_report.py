"""Where requests' time goes between the stack's processes, from the timestamps PDSERVE_TRACE collects
(pdserve/common/trace.py): for every point a request passed, the median time since the router received it, since
the point before it, and the slowest request's time since its receipt (a one-time cost shows there, not in the
median); and the prefill worker's cadence under load: the time from one step's sampling to the next's (its wall time
per step, to hold against the engine's prefill of the same prompts) and from a step's sampling to the next step's
first layer on the host (the host work between two steps' GPU work, plus the first layer's launch).

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
from typing import Optional


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


def report(requests: dict[str, dict[str, int]], origin: str = "router.recv") -> list[dict]:
    """One row per event, in order of its median offset: offset from `origin` (median and max) and gap from the
    row before, ms."""
    offsets: dict[str, list[float]] = defaultdict(list)
    for events in requests.values():
        start = events.get(origin)
        if start is None:
            continue
        for event, t in events.items():
            offsets[event].append((t - start) / 1e6)
    rows = sorted(({"event": e, "requests": len(v), "median_ms": statistics.median(v), "max_ms": max(v)}
                   for e, v in offsets.items()), key=lambda r: r["median_ms"])
    previous = 0.0
    for row in rows:
        row["gap_ms"] = row["median_ms"] - previous
        previous = row["median_ms"]
    return rows


# A first token's way at concurrency 1, point to point: (name, from, to). What precedes router.recv (the client's hop
# in) and follows router.first_out (the hop back) is no process's mark: the client's TTFT less the router's send.
TTFT_PARTS = (("to_prefill_engine", "router.recv", "prefill.queued"),  # the router, its hop, the worker's loop
              ("prefill_step", "prefill.queued", "prefill.sampled"),  # the live engine step: queued to sampled
              ("to_router_send", "prefill.sampled", "router.first_out"),  # the answer's hop and the router's send
              ("router_send", "router.recv", "router.first_out"))  # all the router saw of it


def ttft_parts(requests: dict[str, dict[str, int]], since_ns: Optional[int] = None,
               until_ns: Optional[int] = None) -> Optional[dict]:
    """Where a first token's time went inside the stack: for each of TTFT_PARTS the median over the requests (each
    its own difference, not a difference of medians) that the router received in [since_ns, until_ns] and that passed
    every point, as "<name>_ms", with "requests" (how many). None when no request qualifies. (A first token that went
    out with the decode worker's stream rather than the prefill worker's answer, as one that ends its request does,
    counts the KV transfer and the decode worker in to_router_send; the serving benchmark's requests never end there.)"""
    points = {p for _, a, b in TTFT_PARTS for p in (a, b)}
    chosen = [ev for ev in requests.values() if points <= set(ev)
              and (since_ns is None or ev["router.recv"] >= since_ns)
              and (until_ns is None or ev["router.recv"] <= until_ns)]
    if not chosen:
        return None
    parts = {f"{name}_ms": statistics.median((ev[b] - ev[a]) / 1e6 for ev in chosen) for name, a, b in TTFT_PARTS}
    return {"requests": len(chosen), **parts}


STEP_GROUP_NS = 200_000  # the prompts of one step are marked microseconds apart; steps are milliseconds apart


def cadence(requests: dict[str, dict[str, int]]) -> dict:
    """The prefill worker's steps that completed prompts, from their `prefill.sampled` marks: how many, prompts per
    step, and the median / p10 / p90 (ms) of the time from one such step's sampling to the next one's (`interval`)
    and to the next one's first layer launched (`to_next_layer0`). Steps are told apart by time: marks closer than
    STEP_GROUP_NS are one step. Empty when fewer than two steps were seen."""
    marks = sorted((ev["prefill.sampled"], ev.get("prefill.layer0_done"))
                   for ev in requests.values() if "prefill.sampled" in ev)
    steps: list[list[tuple[int, Optional[int]]]] = []
    for t, layer0 in marks:
        if steps and t - steps[-1][-1][0] < STEP_GROUP_NS:
            steps[-1].append((t, layer0))
        else:
            steps.append([(t, layer0)])
    if len(steps) < 2:
        return {}
    intervals, to_layer0 = [], []
    for before, step in zip(steps, steps[1:]):
        intervals.append((step[0][0] - before[-1][0]) / 1e6)
        launched = [layer0 for _, layer0 in step if layer0 is not None and layer0 > before[-1][0]]
        if launched:
            to_layer0.append((min(launched) - before[-1][0]) / 1e6)
    return {"steps": len(steps), "prompts_per_step": len(marks) / len(steps),
            "interval": _spread(intervals), "to_next_layer0": _spread(to_layer0)}


def _spread(values: list[float]) -> Optional[dict]:
    if not values:
        return None
    values = sorted(values)
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"median_ms": statistics.median(values), "p10_ms": at(0.1), "p90_ms": at(0.9), "n": len(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="the PDSERVE_TRACE folder")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--origin", default="router.recv",
                   help="the point each id is timed from (kv.send: the KV rooms' points, under room<N> ids, from "
                        "their rows' hand-over; e.g. PDSERVE_TRACE over bench_kv_transfer.py)")
    args = p.parse_args()
    requests = load(args.folder)
    rows = report(requests, args.origin)
    timed = sum(1 for e in requests.values() if args.origin in e)
    print(f"{timed} ids timed from {args.origin} ({len(requests)} ids seen) in {args.folder}")
    print(f"{'point':28s} {'ids':>8s} {'since ' + args.origin:>18s} {'since the point before':>24s} "
          f"{'slowest':>16s}")
    for r in rows:
        print(f"{r['event']:28s} {r['requests']:8d} {r['median_ms']:15.2f} ms {r['gap_ms']:21.2f} ms "
              f"{r['max_ms']:13.2f} ms")
    steps = cadence(requests)
    if steps:
        print(f"prefill steps that completed prompts: {steps['steps']} ({steps['prompts_per_step']:.2f} prompts each)")
        for key, what in (("interval", "sampling -> next step's sampling"),
                          ("to_next_layer0", "sampling -> next step's first layer launched")):
            v = steps[key]
            if v:
                print(f"  {what:45s} median {v['median_ms']:8.2f} ms  p10 {v['p10_ms']:8.2f}  p90 {v['p90_ms']:8.2f}"
                      f"  ({v['n']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"folder": args.folder, "requests": timed, "rows": rows, "prefill_cadence": steps}, f,
                      indent=2)


if __name__ == "__main__":
    main()
