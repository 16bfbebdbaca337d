"""Tune the fused-MoE Triton kernels' tiles per token count and write kernels/configs/moe/<shape,device>.json.

For each token count T: random uniform top-k routing, then for each BLOCK_M candidate (both GEMMs walk the same
aligned layout, so they share it) the fastest gate-up config and the fastest down config are timed on their own;
the BLOCK_M with the smallest sum wins. Configs that fail to compile or run out of shared memory are skipped.
Entries already in the file for other token counts are kept.

    python benchmarks/tune_moe.py --quick                       # DeepSeek-V3 shapes, fp8, small search (~minutes)
    python benchmarks/tune_moe.py --tokens 1 16 128 4096 --dtype bf16 --time-budget-s 500
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import cuda_time  # noqa: E402

from pdserve.kernels import moe_configs  # noqa: E402
from pdserve.kernels.gemm import FP8_DTYPE  # noqa: E402

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def search_space(rows_per_expert: float, fp8: bool, quick: bool) -> tuple[list[int], list[dict]]:
    """(BLOCK_M candidates, per-GEMM candidates). FP8 keeps BLOCK_N a multiple of 128 (fused activation quant)
    and BLOCK_K = 128 (one scale group per step)."""
    fits = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows_per_expert)]
    block_ms = fits[-2:] if quick else fits
    if quick:
        grid = dict(BLOCK_N=[128], BLOCK_K=[128 if fp8 else 64], GROUP_M=[1, 16], num_warps=[4], num_stages=[3, 4])
    else:
        grid = dict(BLOCK_N=[128, 256] if fp8 else [64, 128, 256], BLOCK_K=[128] if fp8 else [64, 128],
                    GROUP_M=[1, 16], num_warps=[4, 8], num_stages=[3, 4])
    gemms = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    return block_ms, gemms


def bench(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds per call (CUDA events)."""
    return cuda_time(fn, iters, warmup) * 1e3


def random_experts(num_experts: int, inter: int, hidden: int, fp8: bool):
    """Weights for timing only (values do not matter), built a few experts at a time to bound the temporaries."""
    dtype = FP8_DTYPE if fp8 else torch.bfloat16
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device="cuda")
    w2 = torch.empty(num_experts, hidden, inter, dtype=dtype, device="cuda")
    for lo in range(0, num_experts, 16):
        hi = min(lo + 16, num_experts)
        w13[lo:hi] = (torch.randn(hi - lo, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.05).to(dtype)
        w2[lo:hi] = (torch.randn(hi - lo, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.05).to(dtype)
    if not fp8:
        return w13, w2, None, None
    s13 = torch.rand(num_experts, 2 * inter // 128, -(-hidden // 128), device="cuda") * 1e-2
    s2 = torch.rand(num_experts, -(-hidden // 128), inter // 128, device="cuda") * 1e-2
    return w13, w2, s13, s2


def tune_tokens(tokens: int, args, weights, deadline: float) -> dict | None:
    from pdserve.kernels import moe_align, triton_fp8, triton_moe_kernels as k

    w13, w2, s13, s2 = weights
    fp8 = args.dtype == "fp8"
    x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(tokens, args.experts, device="cuda").topk(args.top_k, dim=1).indices
    topk_w = torch.rand(tokens, args.top_k, device="cuda")
    a, a_scale = triton_fp8.per_token_group_quant(x) if fp8 else (x, None)
    pairs = tokens * args.top_k
    act = torch.empty(pairs, args.inter, dtype=FP8_DTYPE if fp8 else torch.bfloat16, device="cuda")
    act_s = torch.ones(pairs, args.inter // 128, device="cuda") if fp8 else None
    out = torch.empty(pairs, args.hidden, dtype=torch.bfloat16, device="cuda")
    block_ms, gemms = search_space(pairs / args.experts, fp8, args.quick)
    best = None
    for block_m in block_ms:
        aligned = moe_align.align_tokens_layout(ids, args.experts, block_m)
        timed = {}
        for name, call in (
            ("gate_up", lambda c: k.invoke_fused_moe_gemm(a, a_scale, w13, s13, act, act_s, None, aligned,
                                                          args.top_k, True, block_m, c)),
            ("down", lambda c: k.invoke_fused_moe_gemm(act, act_s, w2, s2, out, None, topk_w.view(-1), aligned,
                                                       1, False, block_m, c)),
        ):
            results = []
            for cfg in gemms:
                if time.time() > deadline:
                    return best
                try:
                    results.append((bench(lambda: call(cfg)), cfg))
                except Exception as exc:  # compile failure, out of shared memory: not a candidate
                    print(f"    skip {name} BLOCK_M={block_m} {cfg}: {type(exc).__name__}", flush=True)
            if not results:
                break
            timed[name] = min(results, key=lambda r: r[0])
        if len(timed) == 2:
            total = timed["gate_up"][0] + timed["down"][0]
            print(f"  T={tokens} BLOCK_M={block_m}: gate_up {timed['gate_up'][0]:.3f} ms, "
                  f"down {timed['down'][0]:.3f} ms", flush=True)
            if best is None or total < best[0]:
                best = (total, {"BLOCK_M": block_m, "gate_up": timed["gate_up"][1], "down": timed["down"][1]})
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--inter", type=int, default=2048, help="expert intermediate size I (w2 is E x H x I)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    p.add_argument("--quick", action="store_true", help="a few configs per GEMM instead of the full grid")
    p.add_argument("--time-budget-s", type=float, default=540.0, help="stop and write what is tuned by then")
    p.add_argument("--out-dir", default=str(moe_configs.CONFIG_DIR))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_moe.py needs a CUDA GPU")
    start = time.time()
    deadline = start + args.time_budget_s
    weights = random_experts(args.experts, args.inter, args.hidden, args.dtype == "fp8")
    device = moe_configs.device_name()
    dtype = "fp8_w8a8" if args.dtype == "fp8" else "bfloat16"
    path = os.path.join(args.out_dir, moe_configs.config_file_name(args.experts, args.inter, args.hidden, dtype,
                                                                    device))
    table = {}
    if os.path.isfile(path):
        with open(path) as f:
            table = json.load(f)
    for i, tokens in enumerate(args.tokens):
        # Each token count gets an equal share of what is left, so a slow one cannot starve the rest.
        share = (deadline - time.time()) / (len(args.tokens) - i)
        best = tune_tokens(tokens, args, weights, time.time() + share)
        if best is not None:
            table[str(tokens)] = best[1]
            print(f"T={tokens}: {best[0]:.3f} ms  {best[1]}", flush=True)
        if time.time() > deadline:
            print(f"time budget of {args.time_budget_s:.0f} s spent; token counts after {tokens} not tuned")
            break
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(sorted(table.items(), key=lambda kv: int(kv[0]))), f, indent=2)
    print(f"wrote {path} ({len(table)} token counts) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
