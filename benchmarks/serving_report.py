"""The serving benchmark's report (benchmarks/bench_serving.py): stack / engine ratios per model and concurrency, the
concurrency-1, prompts-only and repeats tables, each of issue 17's targets met or missed, and serving.md."""

from __future__ import annotations

import statistics
from typing import Optional

# The targets (issue 17): ratio at least (throughput) or at most (latency).
TARGETS = {"out_tok_s_c32": 0.90, "out_tok_s_c128": 0.85, "tpot_c1": 1.10, "in_tok_s_c32": 0.80, "ttft_c1": 1.10}


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def rows_of(name: str, stack: dict, engine: dict) -> list[dict]:
    rows = []
    by_batch = {b["batch"]: b for b in engine["batches"]}
    for r in stack["runs"]:
        e = by_batch.get(r["concurrency"])
        if e is None:
            continue
        # A NextN step yields several tokens: there the stack's time per token is held against the engine's
        # (TPOT), in plain decoding against the engine's step (one token each).
        speculating = "--speculative-algorithm" in engine.get("engine_flags", [])
        step = e["decode_step_ms"]
        per_token = e["tpot_ms"] if speculating else step
        rows.append({
            "model": name, "concurrency": r["concurrency"], "prompts": r["num_prompts"], "failed": r["failed"],
            "stack_out_tok_s": r["output_token_throughput"], "engine_out_tok_s": e["output_tok_s"],
            "out_tok_s_ratio": ratio(r["output_token_throughput"], e["output_tok_s"]),
            "stack_tpot_ms": r["tpot"]["mean_ms"], "stack_itl_ms": r["itl"]["mean_ms"], "engine_step_ms": step,
            "engine_tpot_ms": e["tpot_ms"], "speculating": speculating, "engine_per_token_ms": per_token,
            "tpot_ratio": ratio(r["tpot"]["mean_ms"], per_token), "itl_ratio": ratio(r["itl"]["mean_ms"], per_token),
            "stack_ttft_p50_ms": r["ttft"]["median_ms"], "engine_prefill_one_ms": e["prefill_one_ms"],
            "ttft_ratio": ratio(r["ttft"]["median_ms"], e["prefill_one_ms"]),
            # The TTFT target allows the KV transfer on top of 1.10x the prefill: TTFT <= 1.10 x prefill +
            # transfer, i.e. (TTFT - transfer) / prefill <= 1.10, the transfer measured in the same run. (The stack
            # sends the first token before the transfer ends, so its TTFT does not wait for it.)
            "transfer_ms": r.get("transfer_ms"),
            "ttft_less_transfer_ratio": (ratio(r["ttft"]["median_ms"] - r["transfer_ms"], e["prefill_one_ms"])
                                         if r.get("transfer_ms") is not None else None),
            **ttft_parts_of(r),
            "stack_accept_length": r.get("accept_length"), "engine_accept_length": e.get("accept_length"),
            "stack_in_tok_s": r["input_token_throughput"], "engine_prefill_tok_s": e["prefill_tok_s"],
            "in_tok_s_ratio": ratio(r["input_token_throughput"], e["prefill_tok_s"])})
    return rows


# A c=1 run's first tokens split by the stack's trace (bench_serving.py --explain-ttft; trace_report.TTFT_PARTS):
# row key, and its part's name there.
TTFT_PART_KEYS = (("ttft_to_prefill_engine_ms", "to_prefill_engine_ms"), ("ttft_prefill_step_ms", "prefill_step_ms"),
                  ("ttft_to_router_send_ms", "to_router_send_ms"), ("ttft_router_send_ms", "router_send_ms"))


def ttft_parts_of(run: dict) -> dict:
    """The row's TTFT parts (None where the run was not traced), and the client's two hops: its TTFT p50 less the
    router's send (a difference of medians: the client's side has no marks)."""
    parts = run.get("ttft_parts") or {}
    row = {key: parts.get(name) for key, name in TTFT_PART_KEYS}
    send = row["ttft_router_send_ms"]
    row["ttft_client_hops_ms"] = None if send is None else run["ttft"]["median_ms"] - send
    return row


def hop_floor(grpc_hop: Optional[dict]) -> list[dict]:
    """From bench_serving's bare gRPC hop (grpc_hop.py), per idle gap, shortest first: a new call's one-way time, a
    message's on an open stream, and a first token's four hops in a row: the client's new call to the router, then
    three messages on open streams (router -> prefill worker, its answer back, the router's to the client)."""
    rows = sorted((grpc_hop or {}).get("rows", []), key=lambda r: r["gap_ms"])
    return [{"idle_ms": r["gap_ms"], "call_ms": r["unary"]["one_way_ms"], "message_ms": r["stream"]["one_way_ms"],
             "four_hops_ms": r["unary"]["one_way_ms"] + 3 * r["stream"]["one_way_ms"]} for r in rows]


def _f(v, digits=2, suffix="") -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}{suffix}" if abs(v) >= 100 else f"{v:.{digits}f}{suffix}"


def table(rows: list[dict]) -> str:
    head = ("| model | c | failed | out tok/s stack / engine | ratio | TPOT / ITL stack ms | engine step ms (NextN: "
            "TPOT) | TPOT / "
            "step | ITL / step | TTFT p50 ms | engine prefill of 1 prompt ms | TTFT / prefill | in tok/s stack / "
            "engine prefill | ratio |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['concurrency']} | {r['failed']}/{r['prompts']} | {_f(r['stack_out_tok_s'])} / "
            f"{_f(r['engine_out_tok_s'])} | **{_f(r['out_tok_s_ratio'])}** | {_f(r['stack_tpot_ms'])} / "
            f"{_f(r['stack_itl_ms'])} | {_f(r['engine_per_token_ms'])} | **{_f(r['tpot_ratio'])}** | {_f(r['itl_ratio'])} | "
            f"{_f(r['stack_ttft_p50_ms'])} | {_f(r['engine_prefill_one_ms'])} | **{_f(r['ttft_ratio'])}** | "
            f"{_f(r['stack_in_tok_s'])} / {_f(r['engine_prefill_tok_s'])} | **{_f(r['in_tok_s_ratio'])}** |")
    return "\n".join(lines)


def concurrency_one_table(rows: list[dict]) -> str:
    """The c=1 rows' TTFT against the issue's allowance, and NextN's accepted tokens on both sides."""
    lines = ["| model | TTFT p50 ms | engine prefill ms (median, same prompts) | KV transfer ms (mean) | TTFT / prefill "
             "| (TTFT - transfer) / prefill | NextN tokens per round stack / engine |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["concurrency"] != 1:
            continue
        accept = (f"{_f(r['stack_accept_length'])} / {_f(r['engine_accept_length'])}"
                  if r.get("speculating") else "-")
        lines.append(f"| {r['model']} | {_f(r['stack_ttft_p50_ms'])} | {_f(r['engine_prefill_one_ms'])} | "
                     f"{_f(r.get('transfer_ms'))} | {_f(r['ttft_ratio'])} | **{_f(r.get('ttft_less_transfer_ratio'))}** "
                     f"| {accept} |")
    return "\n".join(lines)


def ttft_parts_table(rows: list[dict]) -> str:
    """The traced c=1 rows: where the first token's time went, against the engine's prefill and the allowance."""
    lines = ["| model | TTFT p50 ms | client <-> router hops (TTFT - router's send) | router -> prefill engine's queue "
             "| live prefill step | engine prefill (same prompts) | step / engine | sampling -> router's send | TTFT - "
             "engine prefill | allowed: 10% of the prefill + KV transfer |", "|" + "---|" * 10]
    for r in rows:
        if r["concurrency"] != 1 or r.get("ttft_prefill_step_ms") is None:
            continue
        x = ttft_excess(r)
        lines.append(f"| {r['model']} | {_f(r['stack_ttft_p50_ms'])} | {_f(r['ttft_client_hops_ms'])} | "
                     f"{_f(r['ttft_to_prefill_engine_ms'])} | {_f(x['step'])} | {_f(x['prefill'])} | "
                     f"**{_f(x['step'] / x['prefill'])}** | {_f(r['ttft_to_router_send_ms'])} | "
                     f"{_f(x['added'])} | {_f(x['allowed'])} |")
    return "\n".join(lines)


def ttft_excess(row: dict) -> dict:
    """A traced c=1 row's TTFT against the engine's prefill (ms): "prefill", the live "step", what the stack
    "added" to the prefill, and what the target "allowed" it (10% of the prefill, plus the KV transfer)."""
    prefill = row["engine_prefill_one_ms"]
    return {"prefill": prefill, "step": row["ttft_prefill_step_ms"], "added": row["stack_ttft_p50_ms"] - prefill,
            "allowed": (TARGETS["ttft_c1"] - 1) * prefill + (row.get("transfer_ms") or 0.0)}


# The ratios whose spread over --repeats the repeats table shows, and their column names.
SPREAD = (("out_tok_s_ratio", "out tok/s"), ("tpot_ratio", "TPOT / step"), ("ttft_ratio", "TTFT / prefill"),
          ("ttft_less_transfer_ratio", "(TTFT - transfer) / prefill"), ("in_tok_s_ratio", "in tok/s"),
          ("ratio", "in tok/s, prompts only"))


def median_rows(repeats: list[list[dict]]) -> list[dict]:
    """One row per (model, concurrency) over repeated measurements (each a fresh stack, then the engine alone): every
    number the median of that row's numbers over the repeats (a ratio: the median of each repeat's own stack / engine
    ratio, not a ratio of medians), "failed" and "prompts" summed (one failed request in any repeat counts), and
    "repeats" (how many) and "spread" ({ratio: [each repeat's value]}) added."""
    groups: dict[tuple, list[dict]] = {}
    for rows in repeats:
        for r in rows:
            groups.setdefault((r["model"], r["concurrency"]), []).append(r)
    out = []
    for group in groups.values():
        row = dict(group[0])
        for key, value in group[0].items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or key == "concurrency":
                continue
            if key in ("failed", "prompts"):
                row[key] = sum(r[key] for r in group)
                continue
            values = [r[key] for r in group if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["repeats"] = len(group)
        row["spread"] = {key: [r.get(key) for r in group] for key, _ in SPREAD if key in group[0]}
        out.append(row)
    return out


def repeats_table(rows: list[dict]) -> str:
    """median_rows' rows: each ratio's median and its range over the repeats."""
    keys = [(k, name) for k, name in SPREAD if any(r["spread"].get(k) for r in rows)]
    lines = ["| model | c | repeats | failed | " + " | ".join(f"{name}: median (min-max)" for _, name in keys) + " |",
             "|" + "---|" * (4 + len(keys))]
    for r in rows:
        cells = []
        for key, _ in keys:
            values = [v for v in r["spread"].get(key, []) if v is not None]
            cells.append(f"**{_f(r[key])}** ({_f(min(values))}-{_f(max(values))})" if values else "-")
        lines.append(f"| {r['model']} | {r['concurrency']} | {r['repeats']} | {r['failed']}/{r['prompts']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def prompts_only_rows(name: str, stack: dict, engine: dict) -> list[dict]:
    s, e = stack.get("prompts_only"), engine.get("prompts_only")
    if not s or not e:
        return []
    return [{"model": name, "concurrency": s["concurrency"], "prompts": s["num_prompts"], "failed": s["failed"],
             "stack_in_tok_s": s["input_token_throughput"], "engine_prefill_tok_s": e["prefill_tok_s"],
             "ratio": ratio(s["input_token_throughput"], e["prefill_tok_s"]),
             "stack_ttft_p50_ms": s["ttft"]["median_ms"]}]


def prompts_only_table(rows: list[dict]) -> str:
    lines = ["| model | c | failed | in tok/s stack / engine prefill rate | ratio | TTFT p50 ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['concurrency']} | {r['failed']}/{r['prompts']} | "
                     f"{_f(r['stack_in_tok_s'])} / {_f(r['engine_prefill_tok_s'])} | **{_f(r['ratio'])}** | "
                     f"{_f(r['stack_ttft_p50_ms'])} |")
    return "\n".join(lines)


def shown(v: float, limit: float, at_least: bool) -> str:
    """v with 2 decimals, or with as many more as it takes not to read as the other side of the limit (0.7956
    against 0.80 reads "0.796", not "0.80 ... missed")."""
    def side(x: float) -> bool:
        return x >= limit if at_least else x <= limit

    digits = 2
    while digits < 6 and side(round(v, digits)) != side(v):
        digits += 1
    return f"{v:.{digits}f}"


def targets(rows: list[dict], prompts_only: list[dict] = (), hops: list[dict] = ()) -> list[str]:
    """Each of the issue's targets that this run measured, met or missed; a missed TTFT target with its why where the
    run was traced (`hops`: hop_floor's, where measured)."""
    out = []

    def check(what: str, row: Optional[dict], key: str, limit: float, at_least: bool) -> None:
        if row is None or row.get(key) is None:
            return
        v = row[key]
        met = v >= limit if at_least else v <= limit
        out.append(f"- {what} ({row['model']}): {shown(v, limit, at_least)} {'>=' if at_least else '<='} {limit} "
                   f"target: **{'met' if met else 'missed'}**")

    def ttft_target(row: dict) -> None:
        """Met by the plain ratio, or by the issue's allowance of the transfer time when the transfer is shorter than
        the TTFT (the stack's first token does not wait for it: a longer one, KV that arrives long after the first
        token, says nothing about TTFT and allows nothing)."""
        limit, plain, less, transfer = TARGETS["ttft_c1"], row["ttft_ratio"], row["ttft_less_transfer_ratio"], \
            row["transfer_ms"]
        usable = 0 < transfer < row["stack_ttft_p50_ms"]
        met = plain <= limit or (usable and less <= limit)
        how = ("" if plain <= limit or not met else ", met with the allowance") + (
            "" if usable else f"; the transfer ({transfer:.2f} ms) outlasts the TTFT: no allowance")
        out.append(f"- TTFT p50 at c=1 / engine prefill of the same prompts ({row['model']}): "
                   f"{shown(plain, limit, False)}; less the KV transfer ({transfer:.2f} ms, the issue's allowance): "
                   f"{shown(less, limit, False)}; <= {limit} target{how}: "
                   f"**{'met' if met else 'missed'}**")
        if not met and row.get("ttft_prefill_step_ms") is not None:
            out.append("  - why: " + ttft_why(row, hops))

    for model in dict.fromkeys(r["model"] for r in rows):
        at = {r["concurrency"]: r for r in rows if r["model"] == model}
        check("output tok/s at c=32 / engine at batch 32", at.get(32), "out_tok_s_ratio", TARGETS["out_tok_s_c32"],
              True)
        check("output tok/s at c=128 / engine at batch 128", at.get(128), "out_tok_s_ratio", TARGETS["out_tok_s_c128"],
              True)
        one = at.get(1)
        check("TPOT at c=1 / engine TPOT (NextN)" if one and one.get("speculating") else
              "TPOT at c=1 / engine decode step", one, "tpot_ratio", TARGETS["tpot_c1"], False)
        if one is not None and one.get("ttft_less_transfer_ratio") is not None:
            ttft_target(one)
        else:
            check("TTFT p50 at c=1 / engine prefill of the prompt (transfer time not measured, not added)", one,
                  "ttft_ratio", TARGETS["ttft_c1"], False)
        if model == "v3":
            only = next((r for r in prompts_only if r["model"] == model and r["concurrency"] == 32), None)
            if only is not None:
                check("input tok/s at c=32, prompts only / engine prefill rate", only, "ratio",
                      TARGETS["in_tok_s_c32"], True)
            else:
                check("input tok/s at c=32 / engine prefill rate (decoding included)", at.get(32), "in_tok_s_ratio",
                      TARGETS["in_tok_s_c32"], True)
    failed = sum(r["failed"] for r in rows) + sum(r["failed"] for r in prompts_only)
    out.append(f"- zero failed requests: {failed} failed: **{'met' if failed == 0 else 'missed'}**")
    return out


def ttft_why(row: dict, hops: list[dict]) -> str:
    """Where a missed c=1 TTFT's excess over the engine's prefill went (medians of the traced run, see
    ttft_parts_table), and the floor this host's gRPC hops put under it."""
    x = ttft_excess(row)
    prefill, step, added, allowed = x["prefill"], x["step"], x["added"], x["allowed"]
    around = row["ttft_client_hops_ms"] + row["ttft_to_prefill_engine_ms"] + row["ttft_to_router_send_ms"]
    why = (f"the stack adds {added:.2f} ms to the engine's {prefill:.2f} ms prefill, where {allowed:.2f} ms are "
           f"allowed: its live prefill step took {step:.2f} ms ({step - prefill:+.2f} ms, {step / prefill:.2f}x the "
           f"engine's), and the way around the step {around:.2f} ms (the client's two hops to and from the router "
           f"{row['ttft_client_hops_ms']:.2f}, the router and its hop to the prefill engine "
           f"{row['ttft_to_prefill_engine_ms']:.2f}, the answer's way back to the router's send "
           f"{row['ttft_to_router_send_ms']:.2f})")
    if hops:
        low, high = hops[0], hops[-1]
        cost = [low["four_hops_ms"]] if low is high else [low["four_hops_ms"], high["four_hops_ms"]]
        idle = (f"every process idle {low['idle_ms']:.0f} ms" if low is high else
                f"every process idle {low['idle_ms']:.0f} to {high['idle_ms']:.0f} ms; at c=1 the client and the "
                "router are busy with the decode between two prompts, the prefill worker idle)")
        why += (f". On this host the first token's four hops in a row (the client's new call, three messages on open "
                f"streams) cost {'-'.join(f'{v:.2f}' for v in cost)} ms of bare gRPC before any work ({idle}), "
                f"{'-'.join(f'{v / allowed:.0%}' for v in cost)} of the allowance")
    return why


def summarize(result: dict) -> None:
    """Adds to bench_serving's result its rows (the first repeat's), with --repeats each row's medians over the
    repeats (what the targets are then held to), the targets, and the first run's failures per model."""
    rows, only = [], []
    for name, entry in result["models"].items():
        if "engine" in entry:
            rows += rows_of(name, entry["stack"], entry["engine"])
            only += prompts_only_rows(name, entry["stack"], entry["engine"])
    result["rows"], result["prompts_only_rows"] = rows, only
    repeated = {name: [e for e in [entry, *entry.get("more_repeats", [])] if "engine" in e]
                for name, entry in result["models"].items()}
    spread, spread_only = [], []
    for name, reps in repeated.items():
        if len(reps) > 1:
            spread += median_rows([rows_of(name, e["stack"], e["engine"]) for e in reps])
            spread_only += median_rows([prompts_only_rows(name, e["stack"], e["engine"]) for e in reps])
    result["median_rows"], result["prompts_only_median_rows"] = spread, spread_only
    judged = [r for r in rows if r["model"] not in {m["model"] for m in spread}] + spread
    judged_only = [r for r in only if r["model"] not in {m["model"] for m in spread_only}] + spread_only
    result["targets"] = targets(judged, judged_only, hop_floor(result.get("grpc_hop"))) if judged else []
    result["first_run_failed"] = {name: e["stack"]["runs"][0]["failed"] for name, e in result["models"].items()
                                  if e["stack"]["runs"]}


def markdown(result: dict, command: str, device: str, cold: bool, prompts_only_concurrency: int, repeats: int,
             host_line: str = "") -> str:
    """serving.md from a summarized result."""
    rows, only, spread = result["rows"], result["prompts_only_rows"], result["median_rows"]
    md = ["# Serving benchmark: the stack vs the engine alone", "",
          f"`{command}`", "", f"{result['gpu']}, git {result['git']}, {result['date']}, device {device}"
          + (", cold start (Triton and FlashInfer caches cleared first)" if cold else ""), ""]
    if host_line:  # (benchmarks/host_speed.py)
        md += [host_line, ""]
    hops = hop_floor(result.get("grpc_hop"))
    if hops:  # (benchmarks/grpc_hop.py, --explain-ttft)
        md += [f"A bare gRPC message between two processes, one way (benchmarks/grpc_hop.py, median of "
               f"{result['grpc_hop']['calls']}): " + "; ".join(
                   f"after {h['idle_ms']:.0f} ms idle {h['call_ms']:.2f} ms as a new call, {h['message_ms']:.2f} ms "
                   f"on an open stream, so {h['four_hops_ms']:.2f} ms for a first token's four hops in a row (one "
                   "new call, three stream messages)" for h in hops), ""]
    for name, entry in result["models"].items():
        s = entry["stack"]
        warm = ", ".join(f"{role} {v:.2f} s" for role, v in s.get("warmup_s", {}).items()) or "-"
        md.append(f"- {name}: `{s.get('command', '')}`: up after {s.get('up_s', 0):.1f} s (warm-up {warm}); "
                  f"first run after start-up: {result['first_run_failed'].get(name, '-')} failed"
                  + (f"; engine alone built in {entry['engine']['built_s']:.1f} s, warmed up in "
                     f"{entry['engine']['warmup_s']:.1f} s" if "engine" in entry else "")
                  + (f"; **error**: {entry['error'][:300]}" if "error" in entry else "")
                  + ("; the stacks of the next repeats up after " + ", ".join(
                      f"{e['stack'].get('up_s', 0):.1f} s" for e in entry.get("more_repeats", []))
                     if entry.get("more_repeats") else ""))
    if rows:
        md += ["", "The first repeat:", "", table(rows)] if spread else ["", table(rows)]
        if any(r["concurrency"] == 1 for r in rows):
            md += ["", "Concurrency 1: the engine ran the stack's prompts one at a time (its prefill: the median, as "
                   "TTFT's p50); the KV transfer is the prefill worker's mean over the same run (from its answer to the "
                   "decode worker's confirmation):", "", concurrency_one_table(rows)]
        if any(r.get("ttft_prefill_step_ms") is not None for r in rows):
            md += ["", "Where the concurrency-1 TTFT goes (the stack traced: medians over the run's requests of each "
                   "one's time between its marks; ms):", "", ttft_parts_table(rows)]
        if only:
            md += ["", f"Prompts only ({prompts_only_concurrency} at a time, 1 new token each; the engine: as "
                   "many prompts at once), where the input tok/s above is diluted by decoding:", "",
                   prompts_only_table(only)]
        if spread:
            md += ["", "Over the repeats (each a fresh stack, then the engine alone; per repeat its own ratio; "
                   "failed summed):", "", repeats_table(spread + result["prompts_only_median_rows"])]
        md += ["", "Targets (issue 17)" + (f", judged on the medians over {repeats} repeats ("
                                           f"{', '.join(sorted({r['model'] for r in spread}))})" if spread else "")
               + ":", *result["targets"]]
    return "\n".join(md) + "\n"
