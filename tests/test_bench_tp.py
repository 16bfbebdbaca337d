"""benchmarks/bench_tp.py --dry-run on the CPU: the tp suite's program in its tiny form (the demo model, two Gloo
ranks): every configuration measured in a process of its own, `pdserve generate --tp 2`, the table with each issue-45
target, and the JSON behind it."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from stack import REPO

sys.path.insert(0, str(REPO))
from benchmarks import bench_tp  # noqa: E402


def test_bench_tp_dry_run_measures_every_configuration(tmp_path):
    out = tmp_path / "tp"
    proc = subprocess.run([sys.executable, "benchmarks/bench_tp.py", "--out", str(out), "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "tp.json").read_text())
    for name in ("tp1", "tp2", "tp2-dp", "ep2"):
        r = result[name]
        assert list(r["decode_ms"]) == ["1", "2", "4"] and all(v > 0 for v in r["decode_ms"].values()), r
        assert list(r["prefill_tok_s"]) == ["32", "64"] and all(v > 0 for v in r["prefill_tok_s"].values()), r
        # what the timed steps ran: every request decoding, none preempted (the pool holds them all)
        assert all(ran["mean_running"] == int(b) and ran["steps_with_waiting"] == 0
                   for b, ran in r["decode_ran"].items()), r["decode_ran"]
    # DP attention: a pool per rank, each of the budget left after that rank's weights (MLA whole on every rank)
    dp, tp2 = result["tp2-dp"]["kv"], result["tp2"]["kv"]
    assert dp["pools"] == 2 and tp2["pools"] == 1 and dp["tokens"] == 2 * dp["tokens_per_rank"]
    assert 1.8 < dp["tokens"] / tp2["tokens"] <= 2
    assert result["big"]["exit"] == 0 and len(result["big"]["output_ids"]) == 16
    table = (out / "tp.md").read_text()
    assert table in proc.stdout
    for target in ("decode step TP2 / TP1 at batch 1 <= 0.60", "prefill 32 tokens TP2 / TP1 >= 1.7",
                   "KV capacity DP attention / TP2 >= 1.9", "decode tok/s DP attention / TP2 at batch 4 >= 1",
                   "pdserve generate --tp 2"):
        line = next(line for line in table.splitlines() if target in line)
        assert line.rstrip(" |").endswith(("met", "MISSED")), line


def test_profile_steps_says_where_a_decode_step_goes(trained_model_dir):
    """--profile (gpu.sh tp's): a few steps under torch.profiler, their time per step and busiest operations."""
    from pdserve.cli import build_parser
    from pdserve.cli.engine_args import engine_config_from_args
    from pdserve.engine import LLMEngine

    class Sizes:
        dry_run, decode_ctx, steps = True, 8, 2

    args = build_parser().parse_args(["generate", *bench_tp.engine_flags(Sizes, str(trained_model_dir))])
    engine = LLMEngine(engine_config_from_args(args), progress=lambda _m: None)
    ms, ran = bench_tp.decode_step_ms(engine, torch.Generator().manual_seed(0), 2, 8, 2, profile=True)
    prof = ran["profile"]
    assert ms > 0 and ran["mean_running"] == 2 and ran["steps_with_waiting"] == 0
    assert prof["clock"] == "host" and prof["ms_per_step"] > 0 and 0 <= prof["collective_share"] <= 1
    assert prof["top"] and all(t >= 0 for _, t in prof["top"]) and "aten::mm" in [k for k, _ in prof["top"]]
    # ... and one prompt's prefill, every step it took (gpu.sh tp profiles the shortest prefill length)
    tok_s, pre = bench_tp.prefill_tok_s(engine, torch.Generator().manual_seed(1), 24, 1, profile=True)
    assert tok_s > 0 and pre["ms_per_step"] > 0 and "aten::mm" in [k for k, _ in pre["top"]]
    assert bench_tp.prefill_tok_s(engine, torch.Generator().manual_seed(1), 24, 1)[1] is None
    assert not engine.has_unfinished
