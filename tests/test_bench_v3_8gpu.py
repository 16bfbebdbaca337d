"""benchmarks/bench_v3_8gpu.py (the v3-8gpu suite, issue 47) on the CPU: its --dry-run (the demo model, TP2 over
Gloo, every part and the table), its read-floor arithmetic against V3's sizes computed by hand, the PD placement of
two TP workers on GPUs of their own as `pdserve up` makes it, and gpu.sh declining on a machine without 8 GPUs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import torch

from stack import REPO

sys.path.insert(0, str(REPO))

from benchmarks import bench_v3_8gpu as v3  # noqa: E402
from benchmarks.bench_one_batch import FP8, V3, read_floor  # noqa: E402
from pdserve.config import ModelConfig  # noqa: E402


def test_dry_run_measures_every_part(tmp_path):
    out = tmp_path / "v3"
    proc = subprocess.run([sys.executable, "benchmarks/bench_v3_8gpu.py", "--out", str(out), "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "v3_8gpu.json").read_text())
    for part in ("tp", "dp-ep"):
        r = result[part]
        assert list(r["decode_ms"]) == ["1", "2", "4"] and all(v > 0 for v in r["decode_ms"].values()), r
        assert list(r["prefill_tok_s"]) == ["32", "64"] and r["copy_bw"] > 0, r
        f = r["floor"]["1"]
        assert f["total"] == f["weights"] + f["experts"] + f["kv"] > 0
        assert f["ratio"] == pytest.approx(r["decode_ms"]["1"] / f["floor_ms"])
    # DP attention holds attention whole on each rank: more weight bytes per GPU than TP's shards
    assert result["dp-ep"]["floor"]["1"]["weights"] > result["tp"]["floor"]["1"]["weights"]
    for part in ("tp-nextn", "dp-ep-nextn"):
        n = result[part]["nextn"]
        assert n["tok_s"] > 0 and n["accept_length"] >= 1, n
    pd = result["pd"]
    assert "error" not in pd and pd["runs"] and all(r["failed"] == 0 and r["completed"] for r in pd["runs"]), pd
    assert pd["plan"]["full_model"] > pd["plan"]["budget"] and 1 <= pd["plan"]["layers"] < 61, pd["plan"]
    table = (out / "v3_8gpu.md").read_text()
    assert table in proc.stdout
    targets = [line for line in table.splitlines() if line.startswith(("| batch-1", "| decode step at batch 1",
                                                                          "| zero failed"))]
    assert len(targets) == 7 and all(line.rstrip(" |").endswith(("met", "MISSED")) for line in targets), targets
    # --report rebuilds the same table from the part files
    again = subprocess.run([sys.executable, "benchmarks/bench_v3_8gpu.py", "--out", str(tmp_path / "merged"),
                            "--report", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and (tmp_path / "merged" / "v3_8gpu.md").read_text() == table, again.stderr


def fp8(rows: int, cols: int) -> int:
    """An FP8 weight and its fp32 scales, one per 128x128 block."""
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128) * 4


def v3_attention(heads: int) -> int:  # q_a, q_b, kv_a, kv_b, o and the two latent norms, `heads` of 128
    return (fp8(1536, 7168) + fp8(heads * 192, 1536) + fp8(576, 7168) + fp8(heads * 256, 512)
            + fp8(7168, heads * 128) + (1536 + 512) * 2)


def v3_mlp(inter: int) -> int:  # gate, up, down
    return 2 * fp8(inter, 7168) + fp8(7168, inter)


@pytest.mark.parametrize("ep", [False, True], ids=["tp8", "tp8-dp-ep8"])
def test_read_floor_of_v3_at_tp8_batch_1_by_hand(ep):
    cfg = ModelConfig.from_hf_dict(dict(V3, num_hidden_layers=61, first_k_dense_replace=3, quantization_config=FP8))
    model = v3.rank_model(cfg, torch.bfloat16, 8, ep, ep)
    ctx = 1044
    got = read_floor(model, cfg, 1, ctx, 2, dp_size=8 if ep else 1)
    heads = 128 if ep else 16  # DP attention: MLA whole on every rank
    weights = (61 * (v3_attention(heads) + 2 * 7168 * 2) + 3 * v3_mlp(18432 // 8)
               + 58 * (256 * 7168 * 4 + v3_mlp(2048 // 8))  # fp32 router, shared expert split 8 ways
               + 7168 * 2 + 129280 * 7168 * 2)  # final norm, lm_head (replicated, bf16)
    # one token routes to 8 of 256 experts: TP reads its eighth of each of the 8; EP8 reads on average 1 whole
    # expert of its 32 (8 x 32 / 256)
    experts = 58 * (8 * v3_mlp(2048 // 8) if not ep else 1 * v3_mlp(2048))
    kv = 61 * 576 * 2 * ctx
    assert got["weights"] == weights and got["experts"] == pytest.approx(experts, rel=1e-12) and got["kv"] == kv
    assert got["total"] == pytest.approx(weights + experts + kv, rel=1e-12)
    if not ep:  # 7.6 GB per GPU: 1.8 ms at an H200's copy bandwidth (4.2 TB/s, read + write)
        assert 7e9 < got["total"] < 8e9, got


def test_read_floor_counts_the_experts_a_batch_touches():
    cfg = ModelConfig.from_hf_dict(dict(V3, num_hidden_layers=4, quantization_config=FP8))
    model = v3.rank_model(cfg, torch.bfloat16, 8, True, False)
    one, many = (read_floor(model, cfg, b, 16, 2)["experts"] for b in (1, 128))
    share = 1 - (1 - 8 / 256) ** 128  # each of 32 experts escapes all 128 tokens with probability (248/256)^128
    assert many == pytest.approx(one / (8 / 256) * share, rel=1e-12) and 0.98 < share < 0.99


def test_pd_puts_two_tp_workers_on_gpus_of_their_own():
    eight = v3.pd_layout(8)
    assert eight["tp"] == 4 and eight["ranks"] == {"prefill": [f"cuda:{g}" for g in range(4)],
                                                   "decode": [f"cuda:{g}" for g in range(4, 8)]}
    assert eight["up_args"] == ["--up-arg=--tp=4", "--up-arg=--prefill-gpus=0,1,2,3", "--up-arg=--decode-gpus=4,5,6,7"]
    assert v3.pd_layout(2)["ranks"] == {"prefill": ["cuda:0"], "decode": ["cuda:1"]}


def test_pd_layer_count_fits_the_memory():
    plan = v3.pd_layers(4, 139 * 2**30, 61, 0.9, 8 * 2**30)
    # a V3 MoE layer at TP4: its attention (32 of 128 heads), the router, its quarter of the shared expert and of
    # each of the 256 experts, two norms
    assert plan["per_layer"] == (v3_attention(32) + 256 * 7168 * 4 + v3_mlp(512) + 256 * v3_mlp(512) + 2 * 7168 * 2)
    assert 165e9 < plan["full_model"] < 180e9  # more than an H200 holds
    assert plan["need"] <= plan["budget"] < plan["need_next"] and 30 <= plan["layers"] <= 40, plan
    assert v3.pd_layers(1, 139 * 2**30, 8, 0.9, 8 * 2**30)["layers"] == 8  # two GPUs: --layers 8 fits whole


def test_gpu_sh_says_what_it_needs_on_fewer_gpus():
    have = subprocess.run("nvidia-smi -L 2>/dev/null | grep -c '^GPU'", shell=True, capture_output=True, text=True)
    if int(have.stdout.strip() or 0) >= 2:
        pytest.skip("this machine has GPUs: the suite would run")
    for extra, need in (([], 8), (["--gpus", "2", "--layers", "8"], 2)):
        proc = subprocess.run(["bash", "benchmarks/gpu.sh", "v3-8gpu", *extra], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0 and f"v3-8gpu needs {need} GPUs" in proc.stdout, proc.stdout + proc.stderr
