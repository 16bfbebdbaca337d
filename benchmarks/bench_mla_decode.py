"""MLA decode attention (absorbed, paged latent cache) against the hardware's limits measured in the same run.

Measures device-to-device copy bandwidth (bytes read + written per second) and the bf16 matmul rate, then times
mla_decode of each backend (triton, flashinfer when it imports) at DeepSeek-V3 shapes: R 512, P 64, bf16 cache
(1152 bytes per token), every sequence at --ctx tokens. Reported per case: median time, KV bytes read per call,
achieved GB/s and its fraction of the copy bandwidth; at 128 heads also TFLOP/s and the fraction of the matmul
rate (FLOPs = 2 * B * H * ctx * (576 + 512): scores plus the weighted sum). Not a test: it prints numbers.

    python benchmarks/bench_mla_decode.py --out benchmarks/results/mla_decode.json
    python benchmarks/bench_mla_decode.py --out /tmp/sweep.json --sweep   # also time other triton tile configs
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import cuda_time  # noqa: E402
from pdserve.kernels import flashinfer_attention  # noqa: E402
from pdserve.kernels.triton_support import triton_installed  # noqa: E402

R, P = 512, 64
SCALE = 0.1352  # V3's softmax scale with the YaRN correction (FACTS §5); the value does not change the timing


def copy_bandwidth(iters: int) -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * n / cuda_time(lambda: y.copy_(x), iters, 3)


def matmul_rate(iters: int) -> float:
    """bf16 (4096 x 7168) @ (7168 x 2048), FLOP/s (FACTS §1 measured 632 TFLOP/s on an H100 with this shape)."""
    a = torch.randn(4096, 7168, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(7168, 2048, dtype=torch.bfloat16, device="cuda")
    return 2 * 4096 * 7168 * 2048 / cuda_time(lambda: a @ b, iters, 5)


def decode_inputs(batch: int, heads: int, ctx: int, page_size: int, seed: int = 0):
    """Every sequence at ctx tokens; pages of the pool handed out in random order."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = -(-ctx // page_size)
    num_pages = batch * pages_per_seq
    kv = torch.randn(num_pages * page_size, R + P, generator=gen, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_pages, generator=gen, device="cuda").view(batch, pages_per_seq)
    q_lat = torch.randn(batch, heads, R, generator=gen, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, P, generator=gen, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    return q_lat, q_pe, kv, table, seq_lens


def triton_runner(inputs, page_size: int, config=None, num_splits: Optional[int] = None):
    from pdserve.kernels.triton_mla_decode import mla_decode

    q_lat, q_pe, kv, table, seq_lens = inputs
    out = torch.empty_like(q_lat)
    return lambda: mla_decode(q_lat, q_pe, kv, table, seq_lens, page_size, SCALE, out=out, num_splits=num_splits,
                              config=config)


def flashinfer_runner(inputs, page_size: int):
    q_lat, q_pe, kv, table, seq_lens = inputs
    dec = flashinfer_attention.FlashInferMLADecode(q_lat.device)
    dec.plan(table, seq_lens, q_lat.shape[1], page_size, SCALE, q_lat.dtype, kv.dtype)  # once: run() is timed
    out = torch.empty_like(q_lat)
    return lambda: dec.run(q_lat, q_pe, kv, out=out)


def row(name: str, batch: int, heads: int, ctx: int, page_size: int, seconds: float, copy_bw: float,
        mm_rate: float, **extra) -> dict:
    kv_bytes = batch * ctx * (R + P) * 2
    flops = 2 * batch * heads * ctx * ((R + P) + R)
    r = dict(backend=name, batch=batch, heads=heads, ctx=ctx, page_size=page_size, time_ms=seconds * 1e3,
             kv_bytes_per_call=kv_bytes, achieved_gb_s=kv_bytes / seconds / 1e9,
             fraction_of_copy_bw=kv_bytes / seconds / copy_bw, **extra)
    if heads >= 128:
        r.update(tflop_s=flops / seconds / 1e12, fraction_of_matmul=flops / seconds / mm_rate)
    return r


def sweep_configs():
    from pdserve.kernels.triton_mla_decode import DecodeConfig

    for block_h in (16, 32, 64):  # (64 for 16 heads only pads: skipped in main)
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                for stages in (2, 3):
                    yield DecodeConfig(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=4096, help="tokens per sequence (batch * ctx >= 256k by default)")
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time triton tile configs and split counts")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_decode needs a CUDA GPU")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter is for CPU tests")

    backends = [n for n, ok in (("triton", triton_installed()),
                                ("flashinfer", flashinfer_attention.flashinfer is not None)) if ok]
    skipped = {} if flashinfer_attention.flashinfer is not None else {
        "flashinfer": flashinfer_attention.FLASHINFER_IMPORT_ERROR}
    copy_bw, mm_rate = copy_bandwidth(args.iters), matmul_rate(args.iters)
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s (read + write), "
          f"bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s; backends: {', '.join(backends)}"
          + (f" (flashinfer skipped: {skipped['flashinfer']})" if skipped else ""))

    rows = []
    for heads in args.heads:
        inputs = decode_inputs(args.batch, heads, args.ctx, args.page_size)
        outputs = {}
        for name in backends:
            try:  # a backend that fails here (e.g. FlashInfer's JIT build) is reported, not fatal
                fn = triton_runner(inputs, args.page_size) if name == "triton" else flashinfer_runner(
                    inputs, args.page_size)
                seconds = cuda_time(fn, args.iters, args.warmup)
                outputs[name] = fn().float()
            except Exception as exc:
                skipped[f"{name}@{heads}heads"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{name} at {heads} heads failed: {skipped[f'{name}@{heads}heads']}")
                continue
            rows.append(row(name, args.batch, heads, args.ctx, args.page_size, seconds, copy_bw, mm_rate))
        if len(outputs) == 2:  # the two backends should agree (bf16): a sanity check, not a test
            a, b = outputs["triton"], outputs["flashinfer"]
            rows[-1]["rel_diff_vs_triton"] = float((a - b).norm() / b.norm())
        if args.sweep and "triton" in backends:
            from pdserve.kernels.triton_mla_decode import choose_num_splits

            pages = inputs[3].shape[1]
            for cfg in sweep_configs():
                if cfg.block_h > max(16, heads):
                    continue
                base = choose_num_splits(args.batch, heads, pages, args.page_size, cfg.block_h,
                                         torch.cuda.get_device_properties(0).multi_processor_count)
                for splits in sorted({base, max(1, base // 2), min(pages, base * 2)}):
                    try:
                        seconds = cuda_time(triton_runner(inputs, args.page_size, cfg, splits), args.iters // 2, 3)
                    except Exception as exc:  # e.g. out of shared memory for the largest tiles
                        print(f"  sweep {cfg} splits={splits}: {type(exc).__name__}: {str(exc)[:100]}")
                        continue
                    rows.append(row("triton-sweep", args.batch, heads, args.ctx, args.page_size, seconds, copy_bw,
                                    mm_rate, config=dataclasses.asdict(cfg),
                                    num_splits=splits))
        del inputs

    def show(r: dict) -> None:
        extra = {k: r[k] for k in ("config", "num_splits", "rel_diff_vs_triton") if k in r}
        print(f"{r['backend']:<13}{r['batch']:>4}{r['heads']:>5}{r['ctx']:>6}{r['page_size']:>5}"
              f"{r['time_ms']:>9.3f}{r['achieved_gb_s']:>8.0f}{100 * r['fraction_of_copy_bw']:>6.0f}%"
              + (f"{r['tflop_s']:>9.0f}{100 * r['fraction_of_matmul']:>5.0f}%" if "tflop_s" in r else " " * 15)
              + (f"  {extra}" if extra else ""))

    print(f"\n{'backend':<13}{'B':>4}{'H':>5}{'ctx':>6}{'page':>5}{'ms':>9}{'GB/s':>8}{'%copy':>7}{'TFLOP/s':>9}"
          f"{'%mm':>6}  extra")
    for r in rows:
        if r["backend"] != "triton-sweep":
            show(r)
    for heads in args.heads:  # the three fastest triton configs per head count
        for r in sorted((r for r in rows if r["backend"] == "triton-sweep" and r["heads"] == heads),
                        key=lambda r: r["time_ms"])[:3]:
            show(r)

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv), gpu=torch.cuda.get_device_name(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__, triton=triton_version,
        flashinfer=getattr(flashinfer_attention.flashinfer, "__version__", None), skipped=skipped,
        copy_bandwidth_bytes_s=copy_bw, bf16_matmul_flop_s=mm_rate, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
