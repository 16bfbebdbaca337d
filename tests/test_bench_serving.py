"""benchmarks/bench_serving.py end to end on the CPU with tiny settings: the stack (`pdserve up`) driven by
`pdserve bench`, the engine alone on the same prompts, and the table of their ratios."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stack import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_repeats(tmp_path_factory):
    """One run of the benchmark read by the two tests below: the stack and the engine at c=1 and 2, prompts only,
    --explain-ttft, and a second repeat over a fresh stack (--repeats 2) -> (its folder, serving.json)."""
    out = tmp_path_factory.mktemp("bench-serving") / "serving"
    proc = subprocess.run([sys.executable, "benchmarks/bench_serving.py", "--out", str(out), "--device", "cpu",
                           "--models", "demo", "--concurrency", "1", "2", "--num-prompts", "2",
                           "--demo-input-len", "16", "--demo-output-len", "4", "--prompts-only-concurrency", "2",
                           "--explain-ttft", "--hop-calls", "3", "--repeats", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "serving.json").read_text())


def test_bench_serving_runs_the_stack_and_the_engine(two_repeats):
    out, result = two_repeats
    demo = result["models"]["demo"]
    assert [r["concurrency"] for r in demo["stack"]["runs"]] == [1, 2]
    assert all(r["completed"] == 2 and r["failed"] == 0 for r in demo["stack"]["runs"])
    assert set(demo["stack"]["warmup_s"]) == {"prefill", "decode"} and demo["stack"]["up_s"] > 0
    assert [b["batch"] for b in demo["engine"]["batches"]] == [1, 2]
    # At c=1 the engine ran every prompt of the stack's run alone; the stack's KV transfer time came from the prefill
    # worker's metrics over that run.
    assert demo["engine"]["batches"][0]["prompts"] == 2
    assert all(r["transfer_ms"] > 0 for r in demo["stack"]["runs"]), demo["stack"]["runs"]
    rows = result["rows"]
    assert [(r["model"], r["concurrency"]) for r in rows] == [("demo", 1), ("demo", 2)]
    for r in rows:  # every ratio measured, from numbers of this run
        for key in ("out_tok_s_ratio", "tpot_ratio", "itl_ratio", "ttft_ratio", "in_tok_s_ratio"):
            assert r[key] is not None and r[key] > 0, (key, r)
        assert r["out_tok_s_ratio"] == pytest.approx(r["stack_out_tok_s"] / r["engine_out_tok_s"])
    assert result["first_run_failed"] == {"demo": 0} and result["git"] and result["date"]
    # Prompts only (1 new token each): prefill through the stack against the engine's prefill rate.
    only = demo["stack"]["prompts_only"]
    assert only["completed"] == 2 and only["failed"] == 0 and only["total_output_tokens"] == 2, only
    assert demo["engine"]["prompts_only"]["batch"] == 2
    (row,) = result["prompts_only_rows"]
    engine_rate = demo["engine"]["prompts_only"]["prefill_tok_s"]
    assert row["ratio"] == pytest.approx(only["input_token_throughput"] / engine_rate)
    md = (out / "serving.md").read_text()
    assert "bench_serving.py --out" in md and "| demo | 2 | 0/2 |" in md and "zero failed requests" in md
    assert "Prompts only (2 at a time" in md and "| demo | " in md.split("Concurrency 1:")[1]
    # The CPUs' speed at the start and the end (benchmarks/host_speed.py), every CPU this machine lets it use.
    assert set(result["host_speed"]) == {"start", "end"} and "Host CPUs, at the start: pure-Python loop" in md
    assert all(h["cpus"] == len(h["per_cpu_ms"]) >= 1 and h["fastest_ms"] > 0 for h in result["host_speed"].values())
    one = rows[0]
    assert one["ttft_less_transfer_ratio"] == pytest.approx(
        (one["stack_ttft_p50_ms"] - one["transfer_ms"]) / one["engine_prefill_one_ms"])
    # --explain-ttft: the stack traced, each c=1 first token split at its marks, and this host's bare gRPC hop.
    parts = demo["stack"]["runs"][0]["ttft_parts"]
    assert parts["requests"] == 2 and all(v > 0 for v in parts.values()), parts
    assert "ttft_parts" not in demo["stack"]["runs"][1]  # (c=2: queueing, not the way of one first token)
    assert one["ttft_prefill_step_ms"] == pytest.approx(parts["prefill_step_ms"])
    assert one["ttft_client_hops_ms"] == pytest.approx(one["stack_ttft_p50_ms"] - parts["router_send_ms"])
    busy, idle = result["grpc_hop"]["rows"]
    assert (busy["gap_ms"], idle["gap_ms"]) == (pytest.approx(2), pytest.approx(110))
    assert all(h[kind]["one_way_ms"] > 0 for h in (busy, idle) for kind in ("unary", "stream"))
    assert "Where the concurrency-1 TTFT goes" in md and "A bare gRPC message between two processes, one way" in md
    assert "after 2 ms idle" in md and "after 110 ms idle" in md
    assert sorted(f.name for f in out.iterdir()) == ["demo_up.log", "demo_up_r2.log", "serving.json", "serving.md"]


def test_with_nextn_the_stacks_tpot_is_held_against_the_engines_tpot():
    """A NextN step yields several tokens: the stack's time per token is compared with the engine's time per token,
    not with its step; in plain decoding with the step (one token each)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from serving_report import rows_of, targets

    stack = {"runs": [{"concurrency": 1, "num_prompts": 8, "failed": 0, "output_token_throughput": 900.0,
                       "tpot": {"mean_ms": 0.6}, "itl": {"mean_ms": 1.2}, "ttft": {"median_ms": 30.0},
                       "input_token_throughput": 4000.0}]}
    batch = {"batch": 1, "output_tok_s": 1000.0, "decode_step_ms": 1.1, "tpot_ms": 0.55, "prefill_one_ms": 20.0,
             "prefill_tok_s": 30000.0}
    plain = rows_of("demo", stack, {"engine_flags": ["--model", "m"], "batches": [batch]})[0]
    nextn = rows_of("demo", stack, {"engine_flags": ["--speculative-algorithm", "NEXTN"], "batches": [batch]})[0]
    assert plain["tpot_ratio"] == pytest.approx(0.6 / 1.1) and not plain["speculating"]
    assert nextn["tpot_ratio"] == pytest.approx(0.6 / 0.55) and nextn["itl_ratio"] == pytest.approx(1.2 / 0.55)
    assert any("engine TPOT (NextN) (demo): 1.09 <= 1.1 target: **met**" in line for line in targets([nextn]))


def test_the_ttft_target_allows_the_kv_transfer_measured_in_the_same_run():
    """The issue: TTFT at c=1 within 1.10x the engine's prefill plus the measured transfer time, i.e.
    (TTFT - transfer) / prefill <= 1.10; without a measured transfer the plain ratio is held to 1.10."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_serving import stats_since
    from serving_report import rows_of, targets

    before = {'pdserve_kv_transfer_seconds_sum{role="prefill",transport="cuda_ipc"}': 1.0,
              'pdserve_kv_transfer_seconds_count{role="prefill",transport="cuda_ipc"}': 10.0,
              'pdserve_spec_accept_length_sum{role="decode"}': 20.0,
              'pdserve_spec_accept_length_count{role="decode"}': 10.0}
    after = {**before, 'pdserve_kv_transfer_seconds_sum{role="prefill",transport="cuda_ipc"}': 1.03,
             'pdserve_kv_transfer_seconds_count{role="prefill",transport="cuda_ipc"}': 20.0,
             'pdserve_spec_accept_length_sum{role="decode"}': 50.0,
             'pdserve_spec_accept_length_count{role="decode"}': 20.0}
    stats = stats_since(before, after)
    assert stats["transfer_ms"] == pytest.approx(3.0) and stats["accept_length"] == pytest.approx(3.0)
    assert stats_since(None, after) == {"transfer_ms": None, "accept_length": None, "replay_stretch": None}

    run = {"concurrency": 1, "num_prompts": 8, "failed": 0, "output_token_throughput": 900.0,
           "tpot": {"mean_ms": 1.0}, "itl": {"mean_ms": 1.0}, "ttft": {"median_ms": 34.0},
           "input_token_throughput": 4000.0}
    batch = {"batch": 1, "output_tok_s": 1000.0, "decode_step_ms": 1.0, "tpot_ms": 1.0, "prefill_one_ms": 28.0,
             "prefill_tok_s": 30000.0}
    engine = {"engine_flags": ["--model", "m"], "batches": [batch]}
    (row,) = rows_of("v3", {"runs": [{**run, **stats}]}, engine)
    assert row["ttft_ratio"] == pytest.approx(34 / 28) and row["ttft_less_transfer_ratio"] == pytest.approx(31 / 28)
    assert any("1.21; less the KV transfer (3.00 ms, the issue's allowance): 1.11; <= 1.1 target: **missed**" in line
               for line in targets([row]))
    (row,) = rows_of("v3", {"runs": [{**run, "transfer_ms": 4.0}]}, engine)
    assert any(": 1.07; <= 1.1 target, met with the allowance: **met**" in line for line in targets([row]))
    # KV confirmed long after the first token (here 48 ms after a 34 ms TTFT) allows nothing.
    (row,) = rows_of("v3", {"runs": [{**run, "transfer_ms": 48.0}]}, engine)
    assert row["ttft_less_transfer_ratio"] < 0
    assert any("outlasts the TTFT: no allowance: **missed**" in line for line in targets([row]))
    (row,) = rows_of("v3", {"runs": [{**run, "ttft": {"median_ms": 30.0}, "transfer_ms": 48.0}]}, engine)
    assert any("1.07; less the KV transfer (48.00 ms" in line and "**met**" in line for line in targets([row]))
    (row,) = rows_of("v3", {"runs": [run]}, engine)  # not measured: no allowance
    assert any("(transfer time not measured, not added) (v3): 1.21 <= 1.1 target: **missed**" in line
               for line in targets([row]))


def test_a_missed_ttft_target_says_where_the_time_went_and_what_the_hops_cost():
    """--explain-ttft: a traced c=1 run's first token split at the stack's marks; a missed TTFT target says how much
    the stack added against what the target allows, the live step against the engine's, the hops around it, and
    this host's bare gRPC floor for four hops in a row."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from serving_report import hop_floor, rows_of, targets, ttft_parts_table

    parts = {"requests": 8, "to_prefill_engine_ms": 1.4, "prefill_step_ms": 15.0, "to_router_send_ms": 1.1,
             "router_send_ms": 17.5}
    run = {"concurrency": 1, "num_prompts": 8, "failed": 0, "output_token_throughput": 900.0,
           "tpot": {"mean_ms": 1.0}, "itl": {"mean_ms": 1.0}, "ttft": {"median_ms": 19.0},
           "input_token_throughput": 4000.0, "transfer_ms": 2.0, "ttft_parts": parts}
    engine = {"engine_flags": ["--model", "m"], "batches": [
        {"batch": 1, "output_tok_s": 1000.0, "decode_step_ms": 1.0, "tpot_ms": 1.0, "prefill_one_ms": 12.0,
         "prefill_tok_s": 30000.0}]}
    (row,) = rows_of("demo", {"runs": [run]}, engine)
    assert row["ttft_client_hops_ms"] == pytest.approx(1.5)  # 19.0 - 17.5
    hops = hop_floor({"calls": 30, "rows": [
        {"gap_ms": 110.0, "unary": {"one_way_ms": 1.2, "round_trip_ms": 1.8},
         "stream": {"one_way_ms": 0.6, "round_trip_ms": 1.0}},
        {"gap_ms": 2.0, "unary": {"one_way_ms": 0.8, "round_trip_ms": 1.3},
         "stream": {"one_way_ms": 0.4, "round_trip_ms": 0.7}}]})
    assert [h["idle_ms"] for h in hops] == [2.0, 110.0]  # shortest gap first
    assert [h["four_hops_ms"] for h in hops] == [pytest.approx(2.0), pytest.approx(3.0)]
    lines = targets([row], hops=hops)
    (why,) = [x for x in lines if x.startswith("  - why: ")]
    # 19 - 12 = 7 ms added, 1.2 + 2.0 = 3.2 allowed; the step 15 ms (+3.00, 1.25x); around it 1.5 + 1.4 + 1.1 = 4.0.
    assert "adds 7.00 ms to the engine's 12.00 ms prefill, where 3.20 ms are allowed" in why
    assert "took 15.00 ms (+3.00 ms, 1.25x the engine's)" in why and "the way around the step 4.00 ms" in why
    assert "cost 2.00-3.00 ms of bare gRPC before any work (every process idle 2 to 110 ms;" in why
    assert "), 62%-94% of the allowance" in why
    (why_one_gap,) = [x for x in targets([row], hops=hops[1:]) if "why" in x]
    assert "cost 3.00 ms of bare gRPC before any work (every process idle 110 ms), 94% of the allowance" in why_one_gap
    assert "| demo | 19.00 | 1.50 | 1.40 | 15.00 | 12.00 | **1.25** | 1.10 | 7.00 | 3.20 |" in ttft_parts_table([row])
    # Met, or not traced: no why.
    (met,) = rows_of("demo", {"runs": [{**run, "ttft": {"median_ms": 14.0}}]}, engine)
    assert not [x for x in targets([met], hops=hops) if "why" in x]
    (untraced,) = rows_of("demo", {"runs": [{**run, "ttft_parts": None}]}, engine)
    assert not [x for x in targets([untraced], hops=hops) if "why" in x]
    assert untraced["ttft_client_hops_ms"] is None


def test_repeats_give_each_ratio_over_fresh_stacks_and_judge_the_targets_on_the_medians(two_repeats):
    """--repeats 2: a second fresh stack and a second engine run; per row each ratio's median over the two pairs (each
    repeat's stack against its own engine run), the failures summed, and the targets held to those medians."""
    out, result = two_repeats
    demo = result["models"]["demo"]
    (second,) = demo["more_repeats"]
    assert second["stack"]["up_s"] > 0 and second["stack"]["runs"][0]["completed"] == 2
    assert second["engine"]["batches"][0]["prompts"] == 2
    sys.path.insert(0, str(REPO / "benchmarks"))
    from serving_report import rows_of

    pairs = [rows_of("demo", e["stack"], e["engine"]) for e in (demo, second)]
    assert [r["concurrency"] for r in result["median_rows"]] == [1, 2]
    for i, row in enumerate(result["median_rows"]):
        assert row["repeats"] == 2 and row["failed"] == 0 and row["prompts"] == 4
        for key in ("out_tok_s_ratio", "tpot_ratio", "ttft_less_transfer_ratio"):
            assert row["spread"][key] == [p[i][key] for p in pairs]
            assert row[key] == pytest.approx((pairs[0][i][key] + pairs[1][i][key]) / 2)  # the median of two
    assert [r["concurrency"] for r in result["rows"]] == [1, 2]  # the main table: the first repeat's
    md = (out / "serving.md").read_text()
    assert "Over the repeats" in md and "| demo | 1 | 2 | 0/4 |" in md and "judged on the medians over 2 repeats" in md
    row = result["median_rows"][0]
    assert f"TPOT at c=1 / engine decode step (demo): {row['tpot_ratio']:.2f}" in md


def test_median_rows_take_each_repeats_own_ratio_and_sum_failures():
    """The median of per-repeat ratios, not the ratio of medians; a failure in any repeat stays counted."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from serving_report import median_rows, repeats_table, targets

    def row(stack_tok_s, engine_tok_s, failed):
        return {"model": "demo", "concurrency": 32, "prompts": 64, "failed": failed, "speculating": False,
                "stack_out_tok_s": stack_tok_s, "engine_out_tok_s": engine_tok_s,
                "out_tok_s_ratio": stack_tok_s / engine_tok_s, "transfer_ms": None}

    reps = [[row(90.0, 100.0, 0)], [row(50.0, 100.0, 1)], [row(100.0, 50.0, 0)]]
    (m,) = median_rows(reps)
    assert m["out_tok_s_ratio"] == pytest.approx(0.9)  # per repeat: 0.9, 0.5, 2.0
    assert m["spread"]["out_tok_s_ratio"] == pytest.approx([0.9, 0.5, 2.0])
    assert m["failed"] == 1 and m["prompts"] == 192 and m["repeats"] == 3 and m["transfer_ms"] is None
    (m2,) = median_rows([[row(90.0, 100.0, 0)], [row(60.0, 50.0, 0)]])
    assert m2["out_tok_s_ratio"] == pytest.approx((0.9 + 1.2) / 2)  # not 75 / 75 = 1.0
    assert "**0.90** (0.50-2.00)" in repeats_table([m])
    lines = targets([m])
    assert any("output tok/s at c=32 / engine at batch 32 (demo): 0.90 >= 0.9 target: **met**" in x for x in lines)
    assert any("zero failed requests: 1 failed: **missed**" in x for x in lines)


def test_fewer_prompts_than_the_concurrency_is_refused(tmp_path):
    """The engine runs c prompts at once at batch c; a stack sent fewer than c would be compared with it unfairly."""
    proc = subprocess.run([sys.executable, "benchmarks/bench_serving.py", "--out", str(tmp_path / "o"), "--device",
                           "cpu", "--concurrency", "1", "32", "--num-prompts", "24"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--num-prompts 24 is below the concurrency 32" in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_value_just_past_its_limit_is_not_rounded_onto_it():
    """0.7956 against 0.80 reads 0.796 ... missed (rounded to 0.80 it would read as met); far from the limit, or
    rounding onto it from the side that meets it, two decimals stay."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from serving_report import shown, targets

    assert shown(0.7956, 0.8, True) == "0.796" and shown(0.805, 0.8, True) == "0.81"
    assert shown(1.1049, 1.1, False) == "1.105" and shown(1.0951, 1.1, False) == "1.10"
    assert shown(0.8996, 0.9, True) == "0.8996"
    row = {"model": "v3", "concurrency": 32, "failed": 0, "out_tok_s_ratio": 0.8996}
    assert targets([row])[0] == "- output tok/s at c=32 / engine at batch 32 (v3): 0.8996 >= 0.9 target: **missed**"


def test_the_stack_has_room_for_the_prompts_only_run_at_once():
    """`--concurrency 1 --prompts-only-concurrency 32` once sized the stack for one request: 30 of the 32 prompts-only
    requests failed RESOURCE_EXHAUSTED ("no KV room on this decode worker") on an H200."""
    import argparse

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_serving import engine_flags

    args = argparse.Namespace(concurrency=[1], prompts_only_concurrency=32, page_size=16, num_pages=None,
                              device="cpu", max_num_batched_tokens=2048, cuda_graph_max_bs=None,
                              speculative_num_steps=0, engine_arg=[])
    flags = engine_flags(args, {"dir": "m", "load_format": "auto", "input_len": 2048, "output_len": 64})
    value = lambda name: int(flags[flags.index(name) + 1])  # noqa: E731
    assert value("--max-running-requests") == 32
    assert value("--num-pages") >= 32 * (2048 + 64) // 16
