"""Each serving mechanism's client-visible gain, from `bash benchmarks/gpu.sh knobs`: the same `bench_serving.py` run
with the mechanism on and off, alternating, repeated; one table per mechanism and a verdict.

    python benchmarks/knobs_report.py SUITE_DIR > SUITE_DIR/knobs.md

SUITE_DIR holds <knob>_<mode>_r<k>/serving.json. For each knob, the mode that switches the mechanism on is set in
KNOBS. A gain is read the way a client reads it: output tok/s higher, TTFT p50 and TPOT lower; gain = on / off - 1
for a rate, off / on - 1 for a time, so +5% is a 5% better number either way. A mechanism earns its place where some
metric gains 5% or more in every repeat; where another metric also loses 5% or more in every repeat, it is a trade,
and the verdict names both sides.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections import defaultdict

# knob -> (mode with the mechanism on, mode with it off)
KNOBS = {"pacing": ("auto", "off"), "layerwise": ("on", "off")}
METRICS = (("out tok/s", lambda r: r["output_token_throughput"], "rate"),
           ("TTFT p50 ms", lambda r: r["ttft"]["median_ms"], "time"),
           ("TPOT ms", lambda r: r["tpot"]["mean_ms"], "time"),
           ("E2E p50 ms", lambda r: r["e2e"]["median_ms"], "time"))
THRESHOLD = 0.05


def load_runs(suite: str) -> dict:
    """{knob: {mode: {repeat: {concurrency: run}}}} from every <knob>_<mode>_r<k>/serving.json."""
    runs: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(glob.glob(os.path.join(suite, "*_*_r*", "serving.json"))):
        m = re.fullmatch(r"(\w+?)_(\w+)_r(\d+)", os.path.basename(os.path.dirname(path)))
        if not m:
            continue
        with open(path) as f:
            result = json.load(f)
        for entry in result["models"].values():
            by_c = {r["concurrency"]: r for r in entry["stack"]["runs"]}
            runs[m.group(1)][m.group(2)][int(m.group(3))] = by_c
    return runs


def gain(kind: str, on: float, off: float) -> float:
    return on / off - 1 if kind == "rate" else off / on - 1


def report(knob: str, modes: dict) -> list[str]:
    on_mode, off_mode = KNOBS[knob]
    on_runs, off_runs = modes.get(on_mode, {}), modes.get(off_mode, {})
    repeats = sorted(set(on_runs) & set(off_runs))
    if not repeats:
        return [f"## {knob}", "", f"no pair of runs ({on_mode} and {off_mode}) in this folder", ""]
    lines = [f"## {knob}: {on_mode} (on) vs {off_mode} (off), {len(repeats)} repeats", "",
             "| c | metric | " + " | ".join(f"on / off r{k}" for k in repeats) + " | gain per repeat | failed |",
             "|---|---|" + "---|" * len(repeats) + "---|---|"]
    wins, losses = [], []
    for c in sorted(set.intersection(*(set(on_runs[k]) & set(off_runs[k]) for k in repeats))):
        failed = sum(on_runs[k][c]["failed"] + off_runs[k][c]["failed"] for k in repeats)
        for name, read, kind in METRICS:
            pairs = [(read(on_runs[k][c]), read(off_runs[k][c])) for k in repeats]
            gains = [gain(kind, on, off) for on, off in pairs]
            cells = " | ".join(f"{on:,.1f} / {off:,.1f}" for on, off in pairs)
            lines.append(f"| {c} | {name} | {cells} | {', '.join(f'{g:+.1%}' for g in gains)} | {failed} |")
            if all(g >= THRESHOLD for g in gains):
                wins.append(f"{name} at c={c} ({', '.join(f'{g:+.1%}' for g in gains)})")
            if all(g <= -THRESHOLD for g in gains):
                losses.append(f"{name} at c={c} ({', '.join(f'{g:+.1%}' for g in gains)})")
    lines.append("")
    if wins and not losses:
        verdict = "**keep**: a gain of 5% or more in every repeat: " + "; ".join(wins)
    elif wins:
        verdict = ("**keep, a trade**: gains " + "; ".join(wins) + "; for losses " + "; ".join(losses))
    else:
        verdict = "**remove**: no metric gains 5% in every repeat" + (
            "; losses " + "; ".join(losses) if losses else "")
    return lines + [f"Verdict: {verdict}", ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", help="the knobs suite's folder")
    args = p.parse_args()
    runs = load_runs(args.suite)
    print("# Serving mechanisms on and off through `pdserve up` (`bash benchmarks/gpu.sh knobs`)\n")
    for knob in KNOBS:
        print("\n".join(report(knob, runs.get(knob, {}))))


if __name__ == "__main__":
    main()
