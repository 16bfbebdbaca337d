"""Per-case medians of a kv_trace_call.sh trace (since kv.send, warm-up rooms left out): the rooms numbered as
bench_kv_transfer --paired numbers them (room 1 pairs, then 2 + 12 measured per case, in the script's case order).

    python benchmarks/results/h200/checks/kv_cases.py /tmp/kv1-call/trace_nixl
"""
import os
import statistics
import sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from trace_report import load
folder, per = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 14
req = load(folder)
cases = ["contig 4k", "contig 16k", "shuffled 4k", "shuffled 16k"]
for ci, name in enumerate(cases):
    rooms = [f"room{2 + ci * per + i}" for i in range(2, per)]  # skip the warm-up rooms
    offs = {}
    for r in rooms:
        ev = req.get(r, {})
        t0 = ev.get("kv.send")
        if t0 is None: continue
        for e, t in ev.items():
            offs.setdefault(e, []).append((t - t0) / 1e6)
    rows = sorted(((statistics.median(v), e) for e, v in offs.items() if e != "kv.send"))
    print(f"== {name}: " + "  ".join(f"{e.removeprefix('kv.')} {m:.2f}" for m, e in rows if m > -0.5))
