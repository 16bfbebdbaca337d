"""One table for the disaggregated stack on two GPUs (`bash benchmarks/gpu.sh pd`): prefill on GPU 0 and decode on
GPU 1 over each KV transport, two colocated replicas (a prefill and a decode worker on each GPU, one router) at the
same offered load, and the engine alone on one GPU, each from a `bench_serving.py` run (its serving.json) in the same
call; every target of the two-GPU issue marked met or missed, with why.

    python benchmarks/pd_report.py SUITE_DIR [--model v3] > SUITE_DIR/pd.md

SUITE_DIR holds one folder per layout: pd_auto (cuda_ipc, and the engine alone), pd_nccl, pd_tcp, pd_nixl, colocated, and
long (16k-token prompts at concurrency 1, with the engine alone). A missing folder is a missing row.

How each target is read:
- TPOT against the engine's decode step *at the batch the decode worker ran*: its mean running batch over the run is
  taken by Little's law, output tok/s x mean TPOT (the mean number of requests between their first and last token),
  and the engine's decode step at that batch is interpolated between the batches it ran (linear in the batch).
- The prefill-bound ceiling of output tok/s: the engine's prefill rate at the run's concurrency x output / input
  tokens per request (each prompt must be prefilled once for its output; decode runs on its own GPU).
- TTFT at concurrency 1 less the KV transfer (the prefill worker's own measure, from its answer to the decode
  worker's confirmation) against the engine's prefill of one prompt.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

LAYOUTS = (("pd_auto", "PD, cuda_ipc (auto)"), ("pd_nccl", "PD, nccl"), ("pd_tcp", "PD, tcp"), ("pd_nixl", "PD, nixl"),
           ("colocated", "2 colocated replicas"))
GPU_TRANSPORTS = ("pd_auto", "pd_nccl", "pd_nixl")
SAME_HOST = ("pd_auto", "pd_nccl")  # what NIXL is held against: its TTFT and output within 5% of the best of these


def load(suite: str, name: str, model: str) -> Optional[dict]:
    path = os.path.join(suite, name, "serving.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        result = json.load(f)
    return result["models"].get(model)


def runs_by_c(entry: Optional[dict]) -> dict[int, dict]:
    return {r["concurrency"]: r for r in (entry or {}).get("stack", {}).get("runs", [])}


def interpolate(points: list[tuple[float, float]], x: float) -> Optional[float]:
    """Linear interpolation through (x, y) points sorted by x; clamped to the ends."""
    if not points:
        return None
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def mark(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def report(suite: str, model: str) -> str:
    entries = {name: load(suite, name, model) for name, _ in LAYOUTS}
    engine = ((entries.get("pd_auto") or {}).get("engine") or {}).get("batches", [])
    by_batch = {b["batch"]: b for b in engine}
    step_points = sorted((b["batch"], b["decode_step_ms"]) for b in engine if b.get("decode_step_ms"))
    lines = [f"# Prefill and decode on separate GPUs ({model})", ""]
    top_path = os.path.join(suite, "pd_auto", "serving.json")
    top = json.load(open(top_path)) if os.path.isfile(top_path) else {}
    lines += [f"GPU: {top.get('gpu', '?')}; git {top.get('git', '?')}; {top.get('date', '?')}", ""]
    if not any(entries.values()):
        return "\n".join(lines + ["no runs found"]) + "\n"
    lines += ["| layout | c | out tok/s | TTFT p50 / p99 ms | TPOT mean / p99 ms | transfer ms | mean running batch "
              "| engine step there ms | TPOT / step | out / prefill-bound ceiling | failed |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    derived: dict[tuple[str, int], dict] = {}
    for name, label in LAYOUTS:
        for c, r in sorted(runs_by_c(entries[name]).items()):
            if not r["completed"]:
                lines.append(f"| {label} | {c} | no request completed | | | | | | | | {r['failed']} |")
                continue
            out_s, tpot = r["output_token_throughput"], r["tpot"]["mean_ms"]
            batch = out_s * tpot / 1e3
            step = interpolate(step_points, batch)
            eng = by_batch.get(c, {})
            ceiling = (eng.get("prefill_tok_s") or 0) * r["total_output_tokens"] / max(1, r["total_input_tokens"])
            d = derived[(name, c)] = {"batch": batch, "step": step, "tpot_over_step": tpot / step if step else None,
                                      "out_over_ceiling": out_s / ceiling if ceiling else None, "run": r}
            lines.append(
                f"| {label} | {c} | {out_s:,.0f} | {r['ttft']['median_ms']:.1f} / {r['ttft']['p99_ms']:.1f} | "
                f"{tpot:.2f} / {r['tpot']['p99_ms']:.2f} | {r.get('transfer_ms') or float('nan'):.2f} | {batch:.1f} | "
                + (f"{step:.2f} | {d['tpot_over_step']:.2f} | " if step else "- | - | ")
                + (f"{d['out_over_ceiling']:.2f} | " if d["out_over_ceiling"] else "- | ") + f"{r['failed']} |")
    long = load(suite, "long", model)
    long_engine = {b["batch"]: b for b in ((long or {}).get("engine") or {}).get("batches", [])}
    for c, r in sorted(runs_by_c(long).items()):
        label = f"PD, cuda_ipc, {r['total_input_tokens'] // max(1, r['num_prompts'])}-token prompts"
        if not r["completed"]:
            lines.append(f"| {label} | {c} | no request completed | | | | | | | | {r['failed']} |")
            continue
        lines.append(f"| {label} | {c} | {r['output_token_throughput']:,.0f} | {ms(r['ttft']['median_ms'])} / "
                     f"{ms(r['ttft']['p99_ms'])} | {r['tpot']['mean_ms']:.2f} / {r['tpot']['p99_ms']:.2f} | "
                     f"{r.get('transfer_ms') or float('nan'):.2f} | - | - | - | - | {r['failed']} |")
    lines += ["", "Engine alone (one GPU, same prompts): "
              + "; ".join(f"batch {b['batch']}: decode step {b['decode_step_ms']:.2f} ms, prefill "
                          f"{b['prefill_tok_s']:,.0f} tok/s" for b in engine if b.get("decode_step_ms"))
              + (f"; one prompt's prefill {by_batch[1]['prefill_one_ms']:.1f} ms" if 1 in by_batch else ""), ""]
    lines += ["## Targets", "", "| target | value | verdict |", "|---|---|---|"]
    for name in GPU_TRANSPORTS:
        label = dict(LAYOUTS)[name]
        for c in (32, 128):
            d = derived.get((name, c))
            if d and d["tpot_over_step"] is not None:
                lines.append(f"| {label}: TPOT at c={c} <= 1.15x the engine's step at its running batch | "
                             f"{d['tpot_over_step']:.2f} (batch {d['batch']:.1f}) | {mark(d['tpot_over_step'] <= 1.15)} |")
            if d and d["out_over_ceiling"] is not None:
                lines.append(f"| {label}: output at c={c} >= 0.85 of the prefill-bound ceiling | "
                             f"{d['out_over_ceiling']:.2f} | {mark(d['out_over_ceiling'] >= 0.85)} |")
        d = derived.get((name, 1))
        if d and 1 in by_batch and d["run"].get("transfer_ms") is not None:
            whole = d["run"]["ttft"]["median_ms"] / by_batch[1]["prefill_one_ms"]
            ratio = (d["run"]["ttft"]["median_ms"] - d["run"]["transfer_ms"]) / by_batch[1]["prefill_one_ms"]
            lines.append(f"| {label}: TTFT at c=1 less the transfer <= 1.10x the engine's prefill (the transfer from "
                         f"its first rows: layer by layer it overlaps the forward) | {ratio:.2f} (with it: "
                         f"{whole:.2f}) | {mark(ratio <= 1.10)} |")
    for c, r in sorted(runs_by_c(long).items()):
        if r["completed"] and c in long_engine and r.get("transfer_ms") is not None:
            ratio = (r["ttft"]["median_ms"] - r["transfer_ms"]) / long_engine[c]["prefill_one_ms"]
            lines.append(f"| 16k-token prompts: TTFT at c={c} less the transfer / the engine's prefill (no target) | "
                         f"{ratio:.2f} (with it: {r['ttft']['median_ms'] / long_engine[c]['prefill_one_ms']:.2f}) "
                         f"| - |")
        for c in sorted({c for n, c in derived if n == "pd_tcp"}):
            gpu, tcp = derived.get((name, c)), derived.get(("pd_tcp", c))
            if gpu and tcp:
                g, t = gpu["run"], tcp["run"]
                slower = (g["output_token_throughput"] < 0.95 * t["output_token_throughput"]
                          or g["ttft"]["median_ms"] > 1.05 * t["ttft"]["median_ms"])
                lines.append(f"| {label} not slower than tcp at c={c} (out tok/s, TTFT p50; 5% noise) | "
                             f"{g['output_token_throughput'] / t['output_token_throughput']:.2f}x out, "
                             f"{g['ttft']['median_ms'] / t['ttft']['median_ms']:.2f}x TTFT | {mark(not slower)} |")
    for c in sorted({c for n, c in derived if n == "pd_nixl"}):
        nixl, best = derived[("pd_nixl", c)]["run"], [derived[(n, c)]["run"] for n in SAME_HOST if (n, c) in derived]
        if best:
            out = nixl["output_token_throughput"] / max(r["output_token_throughput"] for r in best)
            ttft = nixl["ttft"]["median_ms"] / min(r["ttft"]["median_ms"] for r in best)
            lines.append(f"| PD, nixl within 5% of the best same-host GPU transport at c={c} (out tok/s, TTFT p50) | "
                         f"{out:.2f}x out, {ttft:.2f}x TTFT | {mark(out >= 0.95 and ttft <= 1.05)} |")
    for c in (32, 128):
        pd, co = derived.get(("pd_auto", c)), derived.get(("colocated", c))
        if pd and co:
            ratio = pd["run"]["tpot"]["p99_ms"] / co["run"]["tpot"]["p99_ms"]
            lines.append(f"| PD's TPOT p99 <= 0.5x two colocated replicas' at c={c} | {ratio:.2f} | "
                         f"{mark(ratio <= 0.5)} |")
            lines.append(f"| (where PD loses) output tok/s PD / colocated at c={c} | "
                         f"{pd['run']['output_token_throughput'] / co['run']['output_token_throughput']:.2f} | - |")
    failed = sum(d["run"]["failed"] for d in derived.values()) + sum(r["failed"] for r in runs_by_c(long).values())
    lines.append(f"| zero failed requests (every run, the first from a fresh machine) | {failed} | {mark(failed == 0)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", help="the pd suite's folder")
    p.add_argument("--model", default="v3")
    args = p.parse_args()
    print(report(args.suite, args.model), end="")


if __name__ == "__main__":
    main()
