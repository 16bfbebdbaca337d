"""DeepGEMM (the installed build) against our kernels and the cuBLAS FP8 ceiling, all in one run:

- dense block-FP8 GEMMs at DeepSeek-V3's projection shapes: DeepGEMM `fp8_gemm_nt`, torch's blockwise `scaled_mm`
  (cuBLAS), our Triton kernel, each on pre-quantized activations, against cuBLAS FP8 per-tensor `torch._scaled_mm`
  at the same (M, N, K); "linear" rows include the per-token-group quantization;
- prefill MoE (E=256, top-8, H=7168, I=2048): DeepGEMM's contiguous gate-up and down GEMMs and the whole layer
  (the "deep_gemm" backend), next to the Triton fused MoE and the Gluon contiguous grouped GEMM
  (bench_moe_gemm.py's measurements, same process); ceiling: cuBLAS FP8 on one dense GEMM of the same rows;
- decode MoE (the masked layout) at batch 1..128 under CUDA graphs: the deep_gemm backend masked and contiguous,
  the Triton backend, and the weight-read floor (experts hit x their fp8 bytes at the copy bandwidth);
- sizes: the MoE layer from 128 to 4096 tokens on each path (where DeepGEMM overtakes Triton);
- linear: the deep_gemm and scaled_mm GEMM backends' `linear` (quantization included) at decode-to-prefill rows;
- decode-linear: the dense linears at decode's rows under CUDA graphs, each call on a weight copy outside the L2,
  scaled_mm and the Triton kernel (its tiles and a grid of others) against the weight-read floor.

    python benchmarks/bench_deep_gemm.py --out benchmarks/results/h200/deep_gemm.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_moe_gemm import (GLUON_CONTIGUOUS, _random_fp8_experts, _rate, _v3_routed,  # noqa: E402
                                       bench_moe, bench_moe_contiguous, cublas_fp8_tflops)
from benchmarks.timing import copy_bandwidth, cuda_time, write_json  # noqa: E402
from pdserve.kernels.gemm import block_quant  # noqa: E402

# V3 projections (N, K): attention q_a / kv_a / q_b / kv_b / o, the dense MLP (layers 0-2), the shared expert.
DENSE = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536), "kv_b": (32768, 512),
         "o_proj": (7168, 16384), "mlp_gate_up": (36864, 7168), "mlp_down": (7168, 18432),
         "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048)}
E, H, I, TOP_K = 256, 7168, 2048, 8


def bench_dense(ms: list[int], shapes: list[str]) -> list[dict]:
    import torch.nn.functional as F

    import deep_gemm
    from pdserve.kernels import deep_gemm_ops, triton_fp8
    from pdserve.kernels.triton_gemm import scaled_mm_blockwise_available, scaled_mm_weight_scale

    gemm = deep_gemm_ops.find_op(deep_gemm, "gemm")
    rows = []
    for name in shapes:
        n, k = DENSE[name]
        wq, ws = block_quant(torch.randn(n, k, device="cuda") * k ** -0.5)
        sb = scaled_mm_weight_scale(ws)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = triton_fp8.per_token_group_quant(x)
            d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            cands = {"deep_gemm": lambda: gemm((xq, xs), (wq, ws), d),
                     "deep_gemm_linear": lambda: gemm(triton_fp8.per_token_group_quant(x), (wq, ws), d),
                     "triton": lambda: triton_fp8.block_fp8_matmul(xq, xs, wq, ws)}
            if scaled_mm_blockwise_available():
                xq4, xs4 = triton_fp8.per_token_group_quant(x, column_major_scales=True, pad_rows_to=4)

                def blockwise(xq4=xq4, xs4=xs4):
                    return F.scaled_mm(xq4, wq.t(), xs4, F.ScalingType.BlockWise1x128, sb,
                                       F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)

                cands["scaled_mm"] = blockwise
                cands["scaled_mm_linear"] = lambda: blockwise(
                    *triton_fp8.per_token_group_quant(x, column_major_scales=True, pad_rows_to=4))
            ceiling = cublas_fp8_tflops(m, n, k)
            row = {"shape": name, "M": m, "N": n, "K": k, "cublas_fp8_tflops": ceiling}
            for label, fn in cands.items():
                try:
                    row[label] = _rate(2 * m * n * k, cuda_time(fn), ceiling)
                except Exception as exc:  # a shape one of them refuses
                    row[label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            rows.append(row)
            print(f"dense {name:>14} M={m:<6} cuBLAS-fp8 {ceiling:7.1f} TF/s | " + " | ".join(
                f"{key} {val['tflops']:6.1f} ({val['fraction_of_cublas']:.0%})" if "tflops" in val else f"{key} ERR"
                for key, val in row.items() if isinstance(val, dict)), flush=True)
    return rows


def bench_moe_deep_gemm(token_counts: list[int]) -> list[dict]:
    """The deep_gemm backend's contiguous path: each grouped GEMM on the prebuilt layout, and the whole layer."""
    from pdserve.kernels import grouped_contract, moe_align, triton_fp8
    from pdserve.kernels import triton_moe_kernels as k
    from pdserve.kernels.deep_gemm_moe import DeepGemmMoE

    moe = DeepGemmMoE(masked_max_tokens=0, triton_max_tokens=0)
    w13, w2, s13, s2 = _random_fp8_experts(E, H, I)
    rows = []
    for tokens in token_counts:
        x, weights, ids = _v3_routed(tokens, E, H, TOP_K)
        pairs = tokens * TOP_K
        aligned = moe_align.align_tokens_layout(ids, E, moe.contiguous_align)
        a, sa, m_indices = grouped_contract.contiguous_layout(*triton_fp8.per_token_group_quant(x), aligned, TOP_K,
                                                              moe.contiguous_align)
        d1 = torch.empty(a.shape[0], 2 * I, dtype=torch.bfloat16, device="cuda")
        d2 = torch.empty(a.shape[0], H, dtype=torch.bfloat16, device="cuda")
        t_gate_up = cuda_time(lambda: moe._contiguous((a, sa), (w13, s13), d1, m_indices), iters=10)
        act, act_s = k.silu_mul_quant(d1)
        t_down = cuda_time(lambda: moe._contiguous((act, act_s), (w2, s2), d2, m_indices), iters=10)
        t_layer = cuda_time(lambda: moe.experts(x, weights, ids, w13, w2, s13, s2, (128, 128)), iters=10)
        gate_up_flops, down_flops = 2 * pairs * 2 * I * H, 2 * pairs * H * I
        ceil_gate_up, ceil_down = cublas_fp8_tflops(pairs, 2 * I, H), cublas_fp8_tflops(pairs, H, I)
        ceil_layer = (gate_up_flops + down_flops) / (gate_up_flops / ceil_gate_up + down_flops / ceil_down)
        row = {"tokens": tokens, "rows": pairs, "rows_padded": int(aligned.num_tokens_post_padded),
               "gate_up": _rate(gate_up_flops, t_gate_up, ceil_gate_up), "down": _rate(down_flops, t_down, ceil_down),
               "layer": _rate(gate_up_flops + down_flops, t_layer, ceil_layer)}
        rows.append(row)
        print(f"deep_gemm MoE T={tokens} (padded {row['rows_padded']}) " + " | ".join(
            f"{name} {row[name]['ms']:.3f} ms {row[name]['tflops']:6.1f} TF/s ({row[name]['fraction_of_cublas']:.0%})"
            for name in ("gate_up", "down", "layer")), flush=True)
    return rows


def graphed_time(fn) -> float:
    """Seconds per replay of `fn` captured in a CUDA graph (decode runs graphed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time(graph.replay, iters=20)


def bench_decode_moe(batches: list[int]) -> list[dict]:
    from pdserve.kernels.deep_gemm_moe import DeepGemmMoE
    from pdserve.kernels.triton_moe import TritonMoE

    w13, w2, s13, s2 = _random_fp8_experts(E, H, I)
    bw = copy_bandwidth()  # bytes read + written per second: the DRAM traffic rate a pure read stream can reach
    backends = {"deep_gemm_masked": DeepGemmMoE(triton_max_tokens=0),
                "deep_gemm_contiguous": DeepGemmMoE(masked_max_tokens=0, triton_max_tokens=0),
                "triton": TritonMoE()}
    rows = []
    for b in batches:
        x, weights, ids = _v3_routed(b, E, H, TOP_K)
        hit = int(torch.unique(ids).numel())
        floor = hit * (w13[0].numel() + w2[0].numel()) / bw
        row = {"batch": b, "experts_hit": hit, "weight_read_floor_ms": floor * 1e3}
        for name, moe in backends.items():
            try:
                t = graphed_time(lambda: moe.experts(x, weights, ids, w13, w2, s13, s2, (128, 128)))
                row[name] = {"ms": t * 1e3, "floor_fraction": floor / t}
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        rows.append(row)
        print(f"decode MoE B={b:<4} experts {hit:3d}, floor {floor * 1e3:.3f} ms | " + " | ".join(
            f"{name} {row[name]['ms']:.3f} ms ({row[name]['floor_fraction']:.0%} of floor)" if "ms" in row[name]
            else f"{name} ERR {row[name]['error']}" for name in backends), flush=True)
    return rows


def bench_moe_sizes(token_counts: list[int]) -> list[dict]:
    """The MoE layer (routing given) from decode to prefill sizes on each path, eager: where DeepGEMM overtakes the
    Triton fused MoE (deep_gemm_moe.TRITON_MAX_TOKENS)."""
    from pdserve.kernels.deep_gemm_moe import DeepGemmMoE
    from pdserve.kernels.triton_moe import TritonMoE

    w13, w2, s13, s2 = _random_fp8_experts(E, H, I)
    paths = {"triton": TritonMoE(), "deep_gemm_contiguous": DeepGemmMoE(masked_max_tokens=0, triton_max_tokens=0),
             "deep_gemm_masked": DeepGemmMoE(masked_max_tokens=1 << 30, triton_max_tokens=0)}
    rows = []
    for tokens in token_counts:
        x, weights, ids = _v3_routed(tokens, E, H, TOP_K)
        row = {"tokens": tokens}
        for name, moe in paths.items():
            if name == "deep_gemm_masked" and tokens > 1024:
                continue  # slabs of T rows per expert: 256 x T x 7168 bf16 outputs
            row[name] = {"ms": cuda_time(lambda: moe.experts(x, weights, ids, w13, w2, s13, s2, (128, 128)),
                                         iters=10) * 1e3}
        rows.append(row)
        print(f"MoE layer T={tokens:<6} " + " | ".join(f"{name} {row[name]['ms']:.3f} ms" for name in paths
                                                       if name in row), flush=True)
    return rows


def bench_dense_backends(ms: list[int], shapes: list[str]) -> list[dict]:
    """The GEMM backends' `linear` (quantization included, as the model calls it): deep_gemm against scaled_mm."""
    from pdserve.kernels.deep_gemm_dense import DeepGemmGemm
    from pdserve.kernels.triton_gemm import ScaledMMGemm

    backends = {"deep_gemm": DeepGemmGemm(min_rows=1), "scaled_mm": ScaledMMGemm()}
    rows = []
    for name in shapes:
        n, k = DENSE[name]
        wq, ws = block_quant(torch.randn(n, k, device="cuda") * k ** -0.5)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "M": m, "N": n, "K": k}
            for label, gemm in backends.items():
                row[label] = {"us": cuda_time(lambda: gemm.linear(x, wq, ws, (128, 128))) * 1e6}
            rows.append(row)
            print(f"linear {name:>14} M={m:<6} " + " | ".join(f"{label} {row[label]['us']:8.1f} us"
                                                            for label in backends), flush=True)
    return rows


def bench_decode_linear(ms: list[int], shapes: list[str]) -> list[dict]:
    """Decode's dense linears as it runs them: under a CUDA graph, one call after another, each on its own copy of
    the weight (enough copies that they overflow the L2, so every call reads HBM as a decode step's layers do), the
    activation quantization included. The scaled_mm backend (what decode runs below deep_gemm's MIN_ROWS) and the
    Triton block-FP8 kernel at its own small-M tiles and at a grid of (BLOCK_N, SPLIT_K), against the weight-read
    floor (the weight's FP8 bytes and block scales at the copy rate)."""
    from pdserve.kernels import triton_fp8
    from pdserve.kernels.triton_gemm import ScaledMMGemm, TritonGemm

    bw = copy_bandwidth()
    backends = {"scaled_mm": ScaledMMGemm(), "triton": TritonGemm()}
    grid = [(bn, split) for bn in (32, 64, 128) for split in (1, 2, 4, 8)]
    rows = []
    for name in shapes:
        n, k = DENSE[name]
        wq, ws = block_quant(torch.randn(n, k, device="cuda") * k ** -0.5)
        nbytes = wq.numel() + ws.numel() * 4
        copies = max(4, -(-(256 << 20) // nbytes))
        weights = [(wq.clone(), ws.clone()) for _ in range(copies)]
        floor_us = nbytes / bw * 1e6
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "M": m, "N": n, "K": k, "weight_bytes": nbytes, "floor_us": floor_us}

            def each(call):
                def run():
                    for w, sc in weights:
                        call(w, sc)
                return run

            cands = {label: each(lambda w, sc, g=gemm: g.linear(x, w, sc, (128, 128)))
                     for label, gemm in backends.items()}
            for bn, split in grid:
                cfg = dict(triton_fp8.dense_config(m, n, k), BLOCK_N=bn, SPLIT_K=split)
                cands[f"triton_n{bn}_k{split}"] = each(
                    lambda w, sc, cfg=cfg: triton_fp8.block_fp8_matmul(*triton_fp8.per_token_group_quant(x), w, sc,
                                                                       torch.bfloat16, config=cfg))
            for label, fn in cands.items():
                try:
                    us = graphed_time(fn) / copies * 1e6
                    row[label] = {"us": us, "x_floor": us / floor_us}
                except Exception as exc:  # a tile the compiler refuses
                    row[label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            best = min((v["us"], key) for key, v in row.items() if isinstance(v, dict) and "us" in v)
            row["best"] = best[1]
            rows.append(row)
            mm, tri = (row[key].get("us", float("nan")) for key in ("scaled_mm", "triton"))
            print(f"decode linear {name:>14} M={m:<3} floor {floor_us:7.1f} us | scaled_mm {mm:7.1f} | triton "
                  f"{tri:7.1f} | best {best[1]} {best[0]:7.1f} us ({best[0] / floor_us:.2f}x the floor)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 128, 4096, 8192, 16384], help="dense GEMM rows")
    p.add_argument("--shapes", nargs="+", default=list(DENSE), choices=list(DENSE))
    p.add_argument("--moe-tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024, 1536, 2048, 3072, 4096],
                   help="tokens for the MoE layer on each path (sizes section)")
    p.add_argument("--linear-m", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048],
                   help="rows for the GEMM backends' linear (linear section)")
    p.add_argument("--decode-linear-m", type=int, nargs="+", default=[1, 4, 16, 32],
                   help="rows for the graphed decode linears (decode-linear section)")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["dense", "moe", "ours", "decode", "sizes", "linear", "decode-linear"],
                   help="sections to leave out (ours: the Triton / Gluon prefill MoE)")
    p.add_argument("--moe-config", help="config table for the Triton fused MoE (kernels/configs/moe/ format; default: "
                                         "the committed one for this GPU, else the untuned default)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    from pdserve.kernels import deep_gemm_ops

    deep_gemm_ops.require_usable()
    import triton

    result = {"command": " ".join(["python"] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "triton": triton.__version__, "deep_gemm": deep_gemm_ops.installed_build()}
    if "dense" not in args.skip:
        result["dense"] = bench_dense(args.m, args.shapes)
    if "moe" not in args.skip:
        result["moe_deep_gemm"] = bench_moe_deep_gemm(args.moe_tokens)
    if "ours" not in args.skip:
        result["moe_triton"] = bench_moe(args.moe_tokens, args.moe_config)
        result["moe_gluon"] = bench_moe_contiguous(args.moe_tokens, GLUON_CONTIGUOUS[:1])
    if "decode" not in args.skip:
        result["decode_moe"] = bench_decode_moe(args.decode_batch)
    if "sizes" not in args.skip:
        result["moe_sizes"] = bench_moe_sizes(args.sizes)
    if "linear" not in args.skip:
        result["dense_linear"] = bench_dense_backends(args.linear_m, args.shapes)
    if "decode-linear" not in args.skip:
        result["decode_linear"] = bench_decode_linear(args.decode_linear_m, args.shapes)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
