"""Tune the fused-MoE Triton kernels' tiles per token count and write the config table (kernels/configs/moe/).

For each token count T: DeepSeek-V3 routing of random logits (as bench_moe_gemm.py; `--routing uniform` for other
shapes), then for each BLOCK_M (both GEMMs walk the same aligned layout, so they share it) every gate-up and every
down candidate is checked against a torch reference on sampled pairs, then timed on its own, with its TF/s and its
fraction of cuBLAS FP8 (`torch._scaled_mm`, per-tensor scales) on the dense GEMM of the same total size (M =
T * top_k, so padding counts against us). The BLOCK_M with the smallest sum of the two best wins. Candidates that
fail to compile, run out of shared memory or fail the check are skipped. Each config compiles once (token counts
are not specialised). Entries already in the output file for other token counts are kept.

    python benchmarks/tune_moe.py --space quick                   # DeepSeek-V3 shapes, fp8, small search (~minutes)
    python benchmarks/tune_moe.py --space prefill --tokens 4096 8192 --out /tmp/moe.json --fill-defaults
    python benchmarks/tune_moe.py --tokens 1 16 128 4096 --dtype bf16 --time-budget-s 500
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import cuda_time  # noqa: E402

from pdserve.kernels import moe_configs  # noqa: E402
from pdserve.kernels.gemm import FP8_DTYPE, block_dequant  # noqa: E402
from pdserve.kernels.moe import RoutingConfig, select_experts  # noqa: E402

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
DEVICE = "cuda"


def gemm(block_n: int, warps: int, stages: int, group_m: int = 16, block_k: int = 128, layout: str = "") -> dict:
    cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps, num_stages=stages)
    if layout:
        cfg["LAYOUT"] = layout
    return cfg


# Prefill sizes (fp8, T >= 4096), by BLOCK_M. BLOCK_N counts weight rows (a gate-up tile of 128 rows yields 64
# activation columns). SGLang's tuned H100/H200/H800 tables for E=256/257 block-FP8 [128, 128] pick BLOCK_M 64,
# BLOCK_N 128, BLOCK_K 128, GROUP_M 16-32, 4 warps, 3-4 stages at 2048-4096 tokens: that point and its neighbours,
# plus the larger tiles that compile without register spills for sm_90 (ptxas, Triton 3.6): 64 x 256 and
# 128 x 128 at 8 warps. 128 x 256 spills, as does a two-accumulator gate-up at 128 x 128. The down GEMM also
# has contiguous-layout candidates (LAYOUT "contiguous": TMA loads, triton_grouped_gemm.py), the best tiles of
# bench_moe_gemm.py --contiguous (see benchmarks/results/README.md, `moe`).
PREFILL = {
    64: {"gate_up": [gemm(256, 8, 3), gemm(256, 8, 4), gemm(256, 8, 4, group_m=8)],
         "down": [gemm(256, 8, 4), gemm(256, 8, 3), gemm(128, 4, 4, group_m=8, layout="contiguous"),
                  gemm(128, 4, 4, group_m=16, layout="contiguous"), gemm(128, 8, 4, group_m=8, layout="contiguous")]},
    128: {"gate_up": [gemm(128, 8, 4)],
          "down": [gemm(128, 8, 4), gemm(128, 8, 4, group_m=8, layout="contiguous"),
                   gemm(128, 8, 3, group_m=8, layout="contiguous")]},
}


def search_space(rows_per_expert: float, fp8: bool, space: str) -> dict[int, dict[str, list[dict]]]:
    """{BLOCK_M: {"gate_up": [configs], "down": [configs]}}. FP8 keeps BLOCK_K = 128 (one scale group per step)
    and gate-up tiles of 128 or 256 weight rows (the activation quantization stays fused)."""
    if space == "prefill":
        if not fp8:
            raise SystemExit("--space prefill is the fp8 prefill set; use quick or full for bf16")
        return PREFILL
    fits = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows_per_expert)]
    block_ms = fits[-2:] if space == "quick" else fits
    if space == "quick":
        grid = dict(BLOCK_N=[128], BLOCK_K=[128 if fp8 else 64], GROUP_M=[1, 16], num_warps=[4], num_stages=[3, 4])
    else:
        grid = dict(BLOCK_N=[128, 256] if fp8 else [64, 128, 256], BLOCK_K=[128] if fp8 else [64, 128],
                    GROUP_M=[1, 16], num_warps=[4, 8], num_stages=[3, 4])
    gemms = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    return {m: {"gate_up": gemms, "down": gemms} for m in block_ms}


def bench(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds per call (CUDA events)."""
    return cuda_time(fn, iters, warmup) * 1e3


def random_experts(num_experts: int, inter: int, hidden: int, fp8: bool):
    """Weights for timing only (values do not matter), built a few experts at a time to bound the temporaries."""
    dtype = FP8_DTYPE if fp8 else torch.bfloat16
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device=DEVICE)
    w2 = torch.empty(num_experts, hidden, inter, dtype=dtype, device=DEVICE)
    for lo in range(0, num_experts, 16):
        hi = min(lo + 16, num_experts)
        w13[lo:hi] = (torch.randn(hi - lo, 2 * inter, hidden, device=DEVICE, dtype=torch.bfloat16) * 0.05).to(dtype)
        w2[lo:hi] = (torch.randn(hi - lo, hidden, inter, device=DEVICE, dtype=torch.bfloat16) * 0.05).to(dtype)
    if not fp8:
        return w13, w2, None, None
    s13 = torch.rand(num_experts, 2 * inter // 128, -(-hidden // 128), device=DEVICE) * 1e-2 + 1e-3
    s2 = torch.rand(num_experts, -(-hidden // 128), inter // 128, device=DEVICE) * 1e-2 + 1e-3
    return w13, w2, s13, s2


def route(tokens: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, top_k), ids (T, top_k)): V3 grouped routing of random logits, or uniform random experts."""
    if args.routing == "v3":
        cfg = RoutingConfig(args.top_k, "sigmoid", "noaux_tc", 8, 4, True, 2.5)
        return select_experts(torch.randn(tokens, args.experts, device=DEVICE),
                              torch.randn(args.experts, device=DEVICE) * 0.1, cfg)
    ids = torch.rand(tokens, args.experts, device=DEVICE).topk(args.top_k, dim=1).indices
    return torch.rand(tokens, args.top_k, device=DEVICE), ids


class PairCheck:
    """fp32 torch reference of a few sampled pairs, from the same quantized inputs as the kernels: the gate-up
    activation against SiLU(gate) * up quantized by the same recipe, the down rows against the kernel's own
    activation times the dequantized w2. A layout or scale error is ~100% off; fp32 summation order is not."""

    def __init__(self, a, a_scale, ids, topk_w, weights, top_k: int, samples: int = 48):
        from pdserve.kernels.triton_fp8 import per_token_group_quant

        self.quant = per_token_group_quant
        w13, w2, s13, s2 = weights
        self.fp8 = w13.dtype == FP8_DTYPE
        pairs = ids.numel()
        self.rows = torch.randperm(pairs, device=DEVICE)[:samples]
        experts = ids.reshape(-1)[self.rows]
        self.topk_w = topk_w.reshape(-1)[self.rows].float()
        xa = self._dequant(self._take(a, self.rows // top_k), a_scale[self.rows // top_k] if self.fp8 else None)
        inter = w2.shape[-1]
        self.h = torch.empty(len(self.rows), inter, device=DEVICE)
        self.w2 = {}
        for e in experts.unique().tolist():
            sel = experts == e
            w13e = block_dequant(w13[e], s13[e], (128, 128)) if self.fp8 else w13[e].float()
            gate_up = xa[sel] @ w13e.T
            self.h[sel] = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            self.w2[e] = block_dequant(w2[e], s2[e], (128, 128)) if self.fp8 else w2[e].float()
        self.experts = experts
        if self.fp8:
            self.h = self._dequant(*self.quant(self.h))

    @staticmethod
    def _take(t, rows):
        # NOTE: gathers fp8 rows through a uint8 view: indexing kernels need not cover the fp8 dtypes.
        return t.view(torch.uint8)[rows].view(t.dtype) if t.dtype == FP8_DTYPE else t[rows]

    @staticmethod
    def _dequant(q, s):
        if s is None:
            return q.float()
        return (q.float().view(q.shape[0], -1, 128) * s[:, :, None]).view(q.shape[0], -1)

    def gate_up(self, act, act_scale) -> float:
        got = self._dequant(self._take(act, self.rows), act_scale[self.rows] if self.fp8 else None)
        # Mean error: a flipped rounding tie moves one code by one fp8 step, rare; a real bug moves everything.
        return ((got - self.h).abs().mean() / self.h.abs().mean()).item()

    def down(self, act, act_scale, out, row_of_pair=None) -> float:
        """row_of_pair: act and out are by layout row (the contiguous down GEMM), out without the routing weight."""
        idx = self.rows if row_of_pair is None else row_of_pair[self.rows]
        h = self._dequant(self._take(act, idx), act_scale[idx] if self.fp8 else None)
        got = out[idx].float()
        if row_of_pair is not None:
            got = got * self.topk_w[:, None]
        ref = torch.empty(len(self.rows), out.shape[1], device=DEVICE)
        for e, w2e in self.w2.items():
            sel = self.experts == e
            ref[sel] = (h[sel] @ w2e.T) * self.topk_w[sel, None]
        return ((got - ref).abs().max() / ref.abs().max()).item()


def cublas_ceilings(pairs: int, inter: int, hidden: int) -> dict:
    from benchmarks.bench_moe_gemm import cublas_fp8_tflops

    return {"gate_up": cublas_fp8_tflops(pairs, 2 * inter, hidden), "down": cublas_fp8_tflops(pairs, hidden, inter)}


def fmt(cfg: dict) -> str:
    return (f"N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} G{cfg['GROUP_M']} w{cfg['num_warps']} s{cfg['num_stages']}"
            f"{' contiguous' if cfg.get('LAYOUT') == 'contiguous' else ''}")


def tune_tokens(tokens: int, args, weights, deadline: float, log: list) -> dict | None:
    from pdserve.kernels import moe_align, triton_fp8, triton_moe_kernels as k

    w13, w2, s13, s2 = weights
    fp8 = args.dtype == "fp8"
    x = torch.randn(tokens, args.hidden, device=DEVICE, dtype=torch.bfloat16)
    topk_w, ids = route(tokens, args)
    a, a_scale = triton_fp8.per_token_group_quant(x) if fp8 else (x, None)
    pairs = tokens * args.top_k
    act = torch.empty(pairs, args.inter, dtype=FP8_DTYPE if fp8 else torch.bfloat16, device=DEVICE)
    act_s = torch.empty(pairs, args.inter // 128, device=DEVICE) if fp8 else None
    out = torch.empty(pairs, args.hidden, dtype=torch.bfloat16, device=DEVICE)
    topk_w_flat = topk_w.reshape(-1).contiguous()
    check = PairCheck(a, a_scale, ids, topk_w, weights, args.top_k)
    flops = {"gate_up": 2 * pairs * 2 * args.inter * args.hidden, "down": 2 * pairs * args.hidden * args.inter}
    ceiling = cublas_ceilings(pairs, args.inter, args.hidden) if fp8 else {}
    print(f"T={tokens}: {pairs} rows; cuBLAS FP8 gate_up {ceiling.get('gate_up', 0):.0f} TF/s, "
          f"down {ceiling.get('down', 0):.0f} TF/s", flush=True)
    best = None
    for block_m, cands in search_space(pairs / args.experts, fp8, args.space).items():
        aligned = moe_align.align_tokens_layout(ids, args.experts, block_m)
        padded = int(aligned.num_tokens_post_padded)
        rows = aligned.sorted_token_ids.numel()
        by_row = {}  # the contiguous down GEMM's inputs, made once per BLOCK_M (see contiguous_inputs)

        def contiguous_inputs():
            """Gate-up's activation by layout row (the best gate-up tile, which fuses the quantization)."""
            if not by_row:
                act_rows = torch.empty(rows, args.inter, dtype=FP8_DTYPE, device=DEVICE)
                act_rows_s = torch.empty(rows, args.inter // 128, device=DEVICE)
                k.invoke_fused_moe_gemm(a, a_scale, w13, s13, act_rows, act_rows_s, None, aligned, args.top_k, True,
                                        block_m, timed["gate_up"][1], out_by_row=True)
                by_row.update(act=act_rows, act_s=act_rows_s, row_of_pair=moe_align.inverse_rows(aligned),
                              out=torch.empty(rows, args.hidden, dtype=torch.bfloat16, device=DEVICE))
            return by_row

        def down(c):
            if c.get("LAYOUT") != "contiguous":
                return k.invoke_fused_moe_gemm(act, act_s, w2, s2, out, None, topk_w_flat, aligned, 1, False,
                                               block_m, c)
            r = contiguous_inputs()
            k.contiguous_down_gemm(r["act"], r["act_s"], w2, s2, r["out"], aligned, c)

        def check_down(c) -> float:
            if c.get("LAYOUT") != "contiguous":
                return check.down(act, act_s, out)
            r = contiguous_inputs()
            return check.down(r["act"], r["act_s"], r["out"], r["row_of_pair"])

        calls = {
            "gate_up": lambda c: k.invoke_fused_moe_gemm(a, a_scale, w13, s13, act, act_s, None, aligned,
                                                         args.top_k, True, block_m, c),
            "down": down,
        }
        timed = {}
        for name in ("gate_up", "down"):  # gate-up first: the down candidates read its activation
            results = []
            for cfg in cands[name]:
                if time.time() > deadline:
                    print(f"  time budget spent at T={tokens} BLOCK_M={block_m} {name}", flush=True)
                    return best
                if name == "gate_up" and fp8 and not k.gate_up_fuses_quant(cfg, args.inter):
                    print(f"    skip gate_up {fmt(cfg)}: does not fuse the activation quantization", flush=True)
                    continue
                row = {"tokens": tokens, "BLOCK_M": block_m, "gemm": name, "config": cfg, "rows_padded": padded}
                try:
                    calls[name](cfg)
                    err = check.gate_up(act, act_s) if name == "gate_up" else check_down(cfg)
                    ms = bench(lambda: calls[name](cfg))
                except Exception as exc:  # compile failure, out of shared memory: not a candidate
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    log.append(row)
                    print(f"    skip {name} BLOCK_M={block_m} {fmt(cfg)}: {row['error']}", flush=True)
                    continue
                ok = err < (5e-3 if name == "gate_up" else 1e-2)
                tflops = flops[name] / ms / 1e9
                frac = tflops / ceiling[name] if name in ceiling else float("nan")
                row.update(ms=ms, tflops=tflops, fraction_of_cublas=frac, check_err=err, check_ok=ok)
                log.append(row)
                print(f"  T={tokens} BLOCK_M={block_m:<3} {name:7s} {fmt(cfg):24s} {ms:7.3f} ms {tflops:6.0f} TF/s "
                      f"({frac:4.0%} of cuBLAS)  check {err:.1e}{'' if ok else ' FAILED'}", flush=True)
                if ok:
                    results.append((ms, cfg))
            if not results:
                break
            timed[name] = min(results, key=lambda r: r[0])
        if len(timed) == 2:
            total = timed["gate_up"][0] + timed["down"][0]
            print(f"  T={tokens} BLOCK_M={block_m}: best gate_up {timed['gate_up'][0]:.3f} ms, "
                  f"down {timed['down'][0]:.3f} ms (padded rows {padded})", flush=True)
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
    p.add_argument("--space", choices=["quick", "full", "prefill"], default="full",
                   help="candidate set: a few per GEMM, the full grid, or the curated fp8 prefill set")
    p.add_argument("--quick", action="store_const", const="quick", dest="space", default=argparse.SUPPRESS,
                   help="same as --space quick")
    p.add_argument("--routing", choices=["v3", "uniform"], default="v3",
                   help="v3: DeepSeek-V3 grouped top-k of random logits (needs experts %% 8 == 0)")
    p.add_argument("--time-budget-s", type=float, default=540.0, help="stop and write what is tuned by then")
    p.add_argument("--out-dir", default=str(moe_configs.CONFIG_DIR))
    p.add_argument("--out", help="write the table to this file instead of <out-dir>/<shape,device name>.json")
    p.add_argument("--fill-defaults", action="store_true",
                   help="add default_config entries for the token counts of --tokens' default list not tuned")
    p.add_argument("--results", help="also write every candidate's timing and check as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_moe.py needs a CUDA GPU")
    if args.routing == "v3" and (args.experts % 8 or args.experts < 16 or args.top_k > args.experts // 2):
        raise SystemExit("--routing v3 groups the experts in 8 groups (top-2 scored, 4 kept): it needs experts a "
                         "multiple of 8, >= 16, and top_k <= experts / 2; use --routing uniform")
    import triton

    start = time.time()
    deadline = start + args.time_budget_s
    fp8 = args.dtype == "fp8"
    weights = random_experts(args.experts, args.inter, args.hidden, fp8)
    device = moe_configs.device_name()
    dtype = "fp8_w8a8" if fp8 else "bfloat16"
    name = moe_configs.config_file_name(args.experts, args.inter, args.hidden, dtype, device)
    path = args.out or os.path.join(args.out_dir, name)
    table = {}
    if os.path.isfile(path):
        with open(path) as f:
            table = json.load(f)
    log: list[dict] = []
    winners = {}

    def write() -> None:
        if args.results:
            meta = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "gpu": device,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__, "triton": triton.__version__, "config_file_name": name}
            with open(args.results, "w") as f:
                json.dump({**meta, "winners": winners, "candidates": log}, f, indent=2)
        if not table:  # nothing tuned: no file, so a table of defaults is never mistaken for a tuned one
            return
        full = dict(table)
        if args.fill_defaults:
            for t in DEFAULT_TOKENS:
                full.setdefault(str(t), moe_configs.default_config(t, args.experts, args.top_k, fp8))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(dict(sorted(full.items(), key=lambda kv: int(kv[0]))), f, indent=2)

    for i, tokens in enumerate(args.tokens):
        # Each token count gets an equal share of what is left, so a slow one cannot starve the rest.
        share = (deadline - time.time()) / (len(args.tokens) - i)
        best = tune_tokens(tokens, args, weights, time.time() + share, log)
        if best is not None:
            table[str(tokens)] = best[1]
            winners[str(tokens)] = {"ms": best[0], **best[1]}
            print(f"T={tokens}: {best[0]:.3f} ms  {best[1]}", flush=True)
        write()  # after every token count, so a run cut short keeps what it tuned
        if time.time() > deadline:
            print(f"time budget of {args.time_budget_s:.0f} s spent; token counts after {tokens} not tuned")
            break
    write()
    if table:
        print(f"wrote {path} ({len(table)} tuned token counts) in {time.time() - start:.0f} s; "
              f"commit it as kernels/configs/moe/{name}")
    else:
        print(f"nothing tuned in {time.time() - start:.0f} s; no table written")


if __name__ == "__main__":
    main()
