"""Block-FP8 dense GEMMs and fused-MoE grouped GEMMs against the cuBLAS FP8 rate measured in the same run.

Ceiling: `torch._scaled_mm` with per-tensor scales (cuBLAS FP8, fp32 accumulation, bf16 out) at the same
(M, N, K). Ours: the Triton block-FP8 GEMM (kernels/triton_fp8.py) and torch's blockwise `scaled_mm` where this
torch has it, timed on pre-quantized activations like the ceiling ("gemm") and with the per-token-group
quantization included ("linear"). MoE (DeepSeek-V3: E=256, top-8, H=7168, I=2048, fp8): the gate-up and down
grouped GEMMs alone and the whole fused layer at prefill sizes; their ceiling is cuBLAS FP8 on one dense GEMM of
the same total size (M = T * top_k rows), so routing imbalance and padding count against us.

    python benchmarks/bench_moe_gemm.py --out /tmp/moe_gemm.json
    python benchmarks/bench_moe_gemm.py --m 1 16 128 4096 8192 --moe-tokens 4096 8192 --sweep
    python benchmarks/bench_moe_gemm.py --skip-dense --moe-config /tmp/moe.json   # a config table not yet committed

NOTE: small-M numbers re-read weights that stay in L2 between iterations; they are upper bounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import copy_bandwidth, cuda_time, write_json  # noqa: E402
from pdserve.kernels.gemm import FP8_DTYPE, block_quant  # noqa: E402
from pdserve.kernels.moe import RoutingConfig, select_experts  # noqa: E402
from pdserve.kernels.triton_gemm import scaled_mm_blockwise_available, scaled_mm_weight_scale  # noqa: E402

DENSE = {"q_a_proj": (1536, 7168), "kv_b_proj": (32768, 512), "o_proj": (7168, 16384), "k640": (2048, 640)}
SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=s, SPLIT_K=1)
         for bm, bn, w, s in [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3),
                              (64, 256, 4, 3), (128, 128, 8, 4)]]




def cublas_fp8_tflops(m: int, n: int, k: int) -> float:
    """cuBLAS FP8 rate at (M, N, K); where it refuses M (alignment), at M rounded up to 16, counting those rows."""
    b = torch.randn(n, k, device="cuda").to(FP8_DTYPE)
    one = torch.ones((), device="cuda")
    for rows in (m, -(-m // 16) * 16):
        a = torch.randn(rows, k, device="cuda").to(FP8_DTYPE)
        try:
            t = cuda_time(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        except RuntimeError:
            continue
        return 2 * rows * n * k / t / 1e12
    raise RuntimeError(f"torch._scaled_mm refused ({m}, {n}, {k})")


def bench_dense(ms: list[int], sweep: bool) -> list[dict]:
    from pdserve.kernels import triton_fp8
    import torch.nn.functional as F

    rows = []
    for name, (n, k) in DENSE.items():
        wq, ws = block_quant(torch.randn(n, k, device="cuda") * k ** -0.5)
        sb = scaled_mm_weight_scale(ws)
        for m in ms:
            flops = 2 * m * n * k
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ceiling = cublas_fp8_tflops(m, n, k)
            xq, xs = triton_fp8.per_token_group_quant(x)
            cands = {"triton_gemm": lambda: triton_fp8.block_fp8_matmul(xq, xs, wq, ws),
                     "triton_linear": lambda: triton_fp8.block_fp8_matmul(*triton_fp8.per_token_group_quant(x), wq, ws)}
            if scaled_mm_blockwise_available():
                xq4, xs4 = triton_fp8.per_token_group_quant(x, column_major_scales=True, pad_rows_to=4)

                def blockwise(xq4=xq4, xs4=xs4):
                    return F.scaled_mm(xq4, wq.t(), xs4, F.ScalingType.BlockWise1x128, sb,
                                       F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)

                def blockwise_linear():
                    return blockwise(*triton_fp8.per_token_group_quant(x, column_major_scales=True, pad_rows_to=4))

                cands["scaled_mm_gemm"], cands["scaled_mm_linear"] = blockwise, blockwise_linear
            if sweep and m >= 1024:
                for i, cfg in enumerate(SWEEP):
                    cands[f"triton_sweep{i}"] = lambda cfg=cfg: triton_fp8.block_fp8_matmul(xq, xs, wq, ws, config=cfg)
            row = {"shape": name, "M": m, "N": n, "K": k, "cublas_fp8_tflops": ceiling}
            for label, fn in cands.items():
                try:
                    tflops = flops / cuda_time(fn) / 1e12
                except Exception as exc:  # e.g. a sweep config out of shared memory, or scaled_mm refusing a shape
                    row[label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    continue
                row[label] = {"tflops": tflops, "fraction_of_cublas": tflops / ceiling}
            if sweep and m >= 1024:
                best = max((i for i in range(len(SWEEP)) if "tflops" in row.get(f"triton_sweep{i}", {})),
                           key=lambda i: row[f"triton_sweep{i}"]["tflops"], default=None)
                row["best_sweep_config"] = SWEEP[best] if best is not None else None
            rows.append(row)
            print_row(row)
    return rows


def bench_moe(token_counts: list[int], config_path: str | None = None) -> list[dict]:
    from pdserve.kernels import moe_align, triton_fp8, triton_moe_kernels as k
    from pdserve.kernels.moe_configs import get_config

    table = None
    if config_path:  # same format as kernels/configs/moe/*.json; a call takes the entry nearest its T
        with open(config_path) as f:
            table = {int(t): cfg for t, cfg in json.load(f).items()}

    num_experts, hidden, inter, top_k = 256, 7168, 2048, 8
    w13, w2, s13, s2 = _random_fp8_experts(num_experts, hidden, inter)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + written)")
    rows = []
    for tokens in token_counts:
        x, weights, ids = _v3_routed(tokens, num_experts, hidden, top_k)
        pairs = tokens * top_k
        if table:
            cfg = table[min(table, key=lambda t: (abs(t - tokens), t))]
        else:
            cfg = get_config(tokens, num_experts, inter, hidden, top_k, FP8_DTYPE)
        block_m = cfg["BLOCK_M"]
        aligned = moe_align.align_tokens_layout(ids, num_experts, block_m)
        a, a_s = triton_fp8.per_token_group_quant(x)
        # A gate-up tile that cannot fuse the 1x128 activation quantization writes bf16 (timed without the
        # separate quantization; the layer time includes it). A contiguous down GEMM reads the activation by
        # layout row and writes by row (the layer's combine then gathers).
        fused = k.gate_up_fuses_quant(cfg["gate_up"], inter)
        by_row = cfg["down"].get("LAYOUT") == "contiguous"
        act_rows = aligned.sorted_token_ids.numel() if by_row else pairs
        act = torch.empty(act_rows, inter, dtype=FP8_DTYPE if fused else torch.bfloat16, device="cuda")
        act_s = torch.empty(act_rows, inter // 128, device="cuda") if fused else None
        out = torch.empty(act_rows, hidden, dtype=torch.bfloat16, device="cuda")
        gate_up_flops, down_flops = 2 * pairs * 2 * inter * hidden, 2 * pairs * hidden * inter
        t_gate_up = cuda_time(lambda: k.invoke_fused_moe_gemm(a, a_s, w13, s13, act, act_s, None, aligned, top_k,
                                                              True, block_m, cfg["gate_up"], out_by_row=by_row),
                              iters=10)
        if not fused:
            act, act_s = triton_fp8.per_token_group_quant(act)
        if by_row:
            t_down = cuda_time(lambda: k.contiguous_down_gemm(act, act_s, w2, s2, out, aligned, cfg["down"]),
                               iters=10)
        else:
            t_down = cuda_time(lambda: k.invoke_fused_moe_gemm(act, act_s, w2, s2, out, None, weights.view(-1),
                                                               aligned, 1, False, block_m, cfg["down"]), iters=10)
        t_layer = cuda_time(lambda: k.fused_experts(x, weights, ids, w13, w2, s13, s2, config=cfg), iters=10)
        ceil_gate_up = cublas_fp8_tflops(pairs, 2 * inter, hidden)
        ceil_down = cublas_fp8_tflops(pairs, hidden, inter)
        ceil_layer = (gate_up_flops + down_flops) / (gate_up_flops / ceil_gate_up + down_flops / ceil_down)
        row = {"tokens": tokens, "rows": pairs, "config": cfg, "config_source": config_path or "moe_configs",
               "rows_padded": int(aligned.num_tokens_post_padded),
               "gate_up": _rate(gate_up_flops, t_gate_up, ceil_gate_up),
               "down": _rate(down_flops, t_down, ceil_down),
               "layer": _rate(gate_up_flops + down_flops, t_layer, ceil_layer)}
        # Weight-read cap: every expert the batch routes to streams its fp8 weights once per GEMM, which the dense
        # ceiling does not; at the copy bandwidth of this run that time alone bounds the grouped GEMM's rate.
        experts_hit = int(torch.unique(ids).numel())
        for name, flops, ceiling, w in (("gate_up", gate_up_flops, ceil_gate_up, w13), ("down", down_flops,
                                                                                        ceil_down, w2)):
            floor_s = experts_hit * w[0].numel() / copy_bw
            row[name]["weight_read_floor_ms"] = floor_s * 1e3
            row[name]["weight_read_cap_of_cublas"] = flops / floor_s / 1e12 / ceiling
        rows.append(row)
        print_moe(row)
    return rows


# Tiles of the contiguous-layout grouped GEMM: (block_m, config). Triton (triton_grouped_gemm.py): BLOCK_N,
# GROUP_M, warps, stages; warp-specialized variants are not timed: they hang on Hopper with Triton 3.6.
# Gluon (gluon_grouped_gemm.py, Hopper): 128 x 128 tiles per 64 rows of 4 warps, STAGES, UNROLL.
def _triton_tile(block_n, group_m, warps, stages):
    return dict(BLOCK_N=block_n, GROUP_M=group_m, num_warps=warps, num_stages=stages)


def _gluon_tile(block_m, group_m, stages, unroll):
    return dict(KERNEL="gluon", GROUP_M=group_m, num_warps=4 * block_m // 64, STAGES=stages, UNROLL=unroll)


CONTIGUOUS = [(128, _triton_tile(128, 8, 8, 4)), (64, _triton_tile(128, 8, 4, 4)), (64, _triton_tile(128, 16, 4, 4))]
GLUON_CONTIGUOUS = [(128, _gluon_tile(128, 8, 4, 2)), (128, _gluon_tile(128, 16, 4, 2)), (128, _gluon_tile(128, 4, 4, 2)),
                    (128, _gluon_tile(128, 8, 5, 2)), (128, _gluon_tile(128, 16, 5, 2)), (128, _gluon_tile(128, 8, 6, 2)),
                    (128, _gluon_tile(128, 8, 4, 3)), (64, _gluon_tile(64, 8, 4, 2)), (64, _gluon_tile(64, 16, 4, 2))]


def bench_moe_contiguous(token_counts: list[int], tiles: list[tuple[int, dict]]) -> list[dict]:
    """The contiguous-layout MoE (DeepGEMM's prefill contract, on our Triton or Gluon grouped GEMM): each tile's two
    grouped GEMMs against cuBLAS FP8 at the same total rows, and the whole layer with its permutation, SiLU-and-mul
    quantization and weighted combine."""
    from pdserve.kernels import grouped_contract, moe_align, triton_fp8, triton_grouped_gemm as gg
    from pdserve.kernels import triton_moe_kernels as k

    num_experts, hidden, inter, top_k = 256, 7168, 2048, 8
    w13, w2, s13, s2 = _random_fp8_experts(num_experts, hidden, inter)
    rows_out = []
    for tokens in token_counts:
        x, weights, ids = _v3_routed(tokens, num_experts, hidden, top_k)
        pairs = tokens * top_k
        ceil_gate_up = cublas_fp8_tflops(pairs, 2 * inter, hidden)
        ceil_down = cublas_fp8_tflops(pairs, hidden, inter)
        gate_up_flops, down_flops = 2 * pairs * 2 * inter * hidden, 2 * pairs * hidden * inter
        ceil_layer = (gate_up_flops + down_flops) / (gate_up_flops / ceil_gate_up + down_flops / ceil_down)
        x_q, x_s = triton_fp8.per_token_group_quant(x)
        layouts = {}
        for block_m, cfg in tiles:
            if block_m not in layouts:
                aligned = moe_align.align_tokens_layout(ids, num_experts, block_m)
                layouts[block_m] = (aligned, *grouped_contract.contiguous_layout(x_q, x_s, aligned, top_k,
                                                                                 align=block_m))
            aligned, a, sa, m_indices = layouts[block_m]
            rows = a.shape[0]
            d1 = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device="cuda")
            d2 = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
            row = {"tokens": tokens, "block_m": block_m, "config": cfg, "rows": pairs,
                   "rows_padded": int(aligned.num_tokens_post_padded)}
            try:
                t_gate_up = cuda_time(lambda: gg.m_grouped_fp8_gemm_nt_contiguous((a, sa), (w13, s13), d1, m_indices,
                                                                                  block_m, cfg), iters=10)
                act, act_s = k.silu_mul_quant(d1)
                t_down = cuda_time(lambda: gg.m_grouped_fp8_gemm_nt_contiguous((act, act_s), (w2, s2), d2, m_indices,
                                                                               block_m, cfg), iters=10)
            except Exception as exc:  # compile failure, out of shared memory
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(f"contiguous T={tokens} block_m={block_m} {cfg}: {row['error']}", flush=True)
                rows_out.append(row)
                continue

            def layer():
                al = moe_align.align_tokens_layout(ids, num_experts, block_m)
                xq, xs = triton_fp8.per_token_group_quant(x)
                a_, sa_, mi = grouped_contract.contiguous_layout(xq, xs, al, top_k, align=block_m)
                gg.m_grouped_fp8_gemm_nt_contiguous((a_, sa_), (w13, s13), d1, mi, block_m, cfg)
                h, h_s = k.silu_mul_quant(d1)
                gg.m_grouped_fp8_gemm_nt_contiguous((h, h_s), (w2, s2), d2, mi, block_m, cfg)
                return k.gather_combine(d2, moe_align.inverse_rows(al), weights, x.dtype)

            t_layer = cuda_time(layer, iters=10)
            row.update(gate_up=_rate(gate_up_flops, t_gate_up, ceil_gate_up), down=_rate(down_flops, t_down, ceil_down),
                       layer=_rate(gate_up_flops + down_flops, t_layer, ceil_layer))
            rows_out.append(row)
            print(f"contiguous T={tokens} block_m={block_m} {cfg} "
                  f"(padded {row['rows_padded']}) " + " | ".join(
                      f"{name} {row[name]['ms']:.3f} ms {row[name]['tflops']:6.1f} TF/s "
                      f"({row[name]['fraction_of_cublas']:.0%})" for name in ("gate_up", "down", "layer")),
                  flush=True)
    return rows_out


def _v3_routed(tokens: int, num_experts: int, hidden: int, top_k: int):
    """Activations (T, H) bf16 and DeepSeek-V3 grouped routing of random logits: weights and ids (T, top_k)."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    routing = RoutingConfig(top_k, "sigmoid", "noaux_tc", 8, 4, True, 2.5)
    weights, ids = select_experts(torch.randn(tokens, num_experts, device="cuda"),
                                  torch.randn(num_experts, device="cuda") * 0.1, routing)
    return x, weights, ids


def _random_fp8_experts(num_experts: int, hidden: int, inter: int):
    """Timing weights (values do not matter), built 16 experts at a time to bound the temporaries."""
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=FP8_DTYPE, device="cuda")
    w2 = torch.empty(num_experts, hidden, inter, dtype=FP8_DTYPE, device="cuda")
    for lo in range(0, num_experts, 16):
        w13[lo:lo + 16] = (torch.randn(16, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.05).to(FP8_DTYPE)
        w2[lo:lo + 16] = (torch.randn(16, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.05).to(FP8_DTYPE)
    s13 = torch.rand(num_experts, 2 * inter // 128, hidden // 128, device="cuda") * 1e-2 + 1e-3
    s2 = torch.rand(num_experts, hidden // 128, inter // 128, device="cuda") * 1e-2 + 1e-3
    return w13, w2, s13, s2


def _rate(flops: float, seconds: float, ceiling: float) -> dict:
    tflops = flops / seconds / 1e12
    return {"ms": seconds * 1e3, "tflops": tflops, "cublas_fp8_tflops": ceiling, "fraction_of_cublas": tflops / ceiling}


def print_row(row: dict) -> None:
    cells = [f"{row['shape']:>9} M={row['M']:<5} cuBLAS-fp8 {row['cublas_fp8_tflops']:7.1f} TF/s"]
    for key, val in row.items():
        if isinstance(val, dict) and "tflops" in val:
            cells.append(f"{key} {val['tflops']:6.1f} ({val['fraction_of_cublas']:.0%})")
    print(" | ".join(cells), flush=True)


def print_moe(row: dict) -> None:
    print(f"MoE T={row['tokens']:<5} rows {row['rows']} (padded {row['rows_padded']}) | "
          + " | ".join(f"{name} {row[name]['ms']:.3f} ms {row[name]['tflops']:6.1f} TF/s "
                       f"({row[name]['fraction_of_cublas']:.0%} of {row[name]['cublas_fp8_tflops']:.0f})"
                       for name in ("gate_up", "down", "layer")), flush=True)
    if "weight_read_floor_ms" in row["gate_up"]:
        print("    weight-read floor at the copy bandwidth: " + ", ".join(
            f"{name} {row[name]['weight_read_floor_ms']:.3f} ms (caps the rate at "
            f"{row[name]['weight_read_cap_of_cublas']:.0%} of cuBLAS)" for name in ("gate_up", "down")), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 128, 4096, 8192], help="dense GEMM rows")
    p.add_argument("--moe-tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--sweep", action="store_true", help="also time a few Triton tile configs at M >= 1024")
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--contiguous", action="store_true",
                   help="also time the contiguous-layout MoE (our Triton grouped GEMM with TMA loads)")
    p.add_argument("--gluon", action="store_true",
                   help="also time the contiguous-layout MoE on the Gluon grouped GEMM (Hopper: each K step's "
                        "promotion under the next step's wgmma)")
    p.add_argument("--moe-config", help="MoE config table (kernels/configs/moe/ format) to use instead of the "
                                         "committed one for this GPU")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_gemm.py needs a CUDA GPU")
    import triton

    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "triton": triton.__version__, "scaled_mm_blockwise": scaled_mm_blockwise_available()}
    if not args.skip_dense:
        result["dense"] = bench_dense(args.m, args.sweep)
    if not args.skip_moe:
        result["moe"] = bench_moe(args.moe_tokens, args.moe_config)
    if args.contiguous:
        result["moe_contiguous"] = bench_moe_contiguous(args.moe_tokens, CONTIGUOUS)
    if args.gluon:
        result["moe_gluon"] = bench_moe_contiguous(args.moe_tokens, GLUON_CONTIGUOUS)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
