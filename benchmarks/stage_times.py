"""Where a stack's TTFT goes, from its own Prometheus metrics: the router's TTFT, the prefill worker's (request
arrival there -> first token sampled) and the KV transfer's time, each as a mean over an interval.

    python benchmarks/stage_times.py UP_LOG --save before.json     # snapshot every /metrics endpoint `up` listed
    ... drive the stack ...
    python benchmarks/stage_times.py UP_LOG --since before.json    # the means of what happened in between

UP_LOG: what `pdserve up` printed (its "metrics on :PORT" and "router metrics http://...:PORT/metrics" lines).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request

# Histograms whose _sum and _count are read; the role label tells the router and the workers apart.
SERIES = ("pdserve_time_to_first_token_seconds", "pdserve_kv_transfer_seconds")


def metrics_ports(up_log: str) -> list[int]:
    text = open(up_log).read()
    ports = re.findall(r"metrics on :(\d+)", text) + re.findall(r"router metrics\s+http://[^:]+:(\d+)/metrics", text)
    return sorted({int(p) for p in ports})


def scrape(port: int, series: tuple[str, ...] = SERIES) -> dict[str, float]:
    """{'<metric>_<sum|count>{labels}': value} for the histograms in `series`."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        m = re.match(r"^(\w+)_(sum|count)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in series:
            out[f"{m.group(1)}_{m.group(2)}{m.group(3) or ''}"] = float(m.group(4))
    return out


def snapshot(up_log: str, series: tuple[str, ...] = SERIES) -> dict[str, float]:
    snap = {}
    for port in metrics_ports(up_log):
        snap.update(scrape(port, series))
    return snap


def interval_means(before: dict[str, float], after: dict[str, float]) -> dict[str, tuple[float, int]]:
    """{'<metric>{labels}': (mean, count)} over the interval, for series that moved (means in the histogram's unit:
    seconds for the SERIES)."""
    means = {}
    for key, total in after.items():
        if "_sum" not in key:
            continue
        name = key.replace("_sum", "", 1)
        count = after.get(key.replace("_sum", "_count", 1), 0) - before.get(key.replace("_sum", "_count", 1), 0)
        if count > 0:
            means[name] = ((total - before.get(key, 0.0)) / count, int(count))
    return means


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("up_log")
    p.add_argument("--save", metavar="FILE", help="write the snapshot here")
    p.add_argument("--since", metavar="FILE", help="print the means since this snapshot")
    args = p.parse_args(argv)
    snap = snapshot(args.up_log)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(snap, f)
    if args.since:
        for name, (mean, count) in sorted(interval_means(json.load(open(args.since)), snap).items()):
            print(f"  {name:70s} mean {mean * 1e3:9.2f} ms over {count}")
    if not (args.save or args.since):
        json.dump(snap, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
