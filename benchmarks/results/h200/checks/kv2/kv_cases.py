"""Per-case medians of a kv_trace_call.sh trace (ms since each room's kv.send, warm-up rooms left out), the cases
named from the bench's JSON in the order bench_kv_transfer --paired numbers their rooms (room 1 pairs, then
warmup + iters rooms per case from room 2).

    python benchmarks/results/h200/checks/kv2/kv_cases.py /tmp/kv2-call/trace_nixl /tmp/kv2-call/kv2/traced_nixl.json
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
from trace_report import load  # noqa: E402

folder, bench = sys.argv[1], json.load(open(sys.argv[2]))
argv = bench["command"].split()
warmup = int(argv[argv.index("--warmup") + 1]) if "--warmup" in argv else 2
iters = len(bench["cases"][0]["ours"]["all_seconds"])
req = load(folder)
for ci, case in enumerate(bench["cases"]):
    first = 2 + ci * (warmup + iters)
    offs = {}
    for r in (f"room{first + i}" for i in range(warmup, warmup + iters)):
        ev = req.get(r, {})
        t0 = ev.get("kv.send")
        if t0 is None:
            continue
        for e, t in ev.items():
            offs.setdefault(e, []).append((t - t0) / 1e6)
    rows = sorted((statistics.median(v), e) for e, v in offs.items() if e != "kv.send")
    name = f"{case['page_order']} {case['tokens'] // 1024}k chunks<={case['max_chunks']}"
    print(f"== {name} ({case['ours']['seconds'] * 1e3:.2f} ms): "
          + "  ".join(f"{e.removeprefix('kv.')} {m:.2f}" for m, e in rows if m > -0.5))
