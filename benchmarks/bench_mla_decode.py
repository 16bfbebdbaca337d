"""MLA decode attention (absorbed, paged latent cache) against the hardware's limits measured in the same run.

Measures device-to-device copy bandwidth (bytes read + written per second) and the bf16 matmul rate, then times
mla_decode of each backend (triton, flashinfer when it imports) at DeepSeek-V3 shapes: R 512, P 64, bf16 cache
(1152 bytes per token), every sequence at --ctx tokens. Two timings per case: `time_ms`, one call between CUDA
events on an idle GPU (it includes the host's launch cost, as in earlier results), and `graph.time_ms`, calls
replayed from a CUDA graph (kernel time only: what a graph-captured decode step pays). With each: GB/s of KV read
and its fraction of the copy bandwidth; at 128 heads also TFLOP/s and the fraction of the matmul rate
(FLOPs = 2 * B * H * ctx * (576 + 512): scores plus the weighted sum). Every output is compared with an fp32 torch
reference (largest relative error of a row). Not a test: it prints numbers.

--sweep also times triton tile configs (block_h, block_n, num_warps, num_stages), graph-timed, each at every split
count that choose_num_splits gives over a grid of its two knobs (DecodeConfig's programs_per_sm and
min_tokens_per_split), likeliest winners first. Worker processes compile the candidates in parallel into Triton's
on-disk cache (compile_only: no kernel runs there) and build FlashInfer's JIT module while this process measures;
FlashInfer is timed after the sweep. --time-budget-s bounds the whole run, counted from start-up: the candidates
not tried by then are listed. It ends with the lines to paste into kernels/triton_mla_decode.py.

    python benchmarks/bench_mla_decode.py --out /tmp/mla_decode.json                               # gpu.sh mla
    python benchmarks/bench_mla_decode.py --out /tmp/mla_sweep.json --sweep --time-budget-s 100    # gpu.sh mla-tune
"""

from __future__ import annotations

import time

START = time.monotonic()  # the time budget counts from here (imports included)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import copy_bandwidth, cuda_time  # noqa: E402
from pdserve.kernels.triton_support import triton_installed  # noqa: E402

R, P = 512, 64
SCALE = 0.1352  # V3's softmax scale with the YaRN correction (FACTS §5); the value does not change the timing
MAX_REL_ERR = 2e-2  # as tests/test_gpu_attention.py for bf16: a candidate above it is reported, never recommended
RESERVE_S = 12.0  # of the time budget, kept after the sweep for FlashInfer's timings and the report
MARGIN = 0.01  # a recommendation replaces the current default only when this much faster: not on noise
TILE_FIELDS = ("block_h", "block_n", "num_warps", "num_stages")
PROGRAMS_PER_SM_GRID = (0.5, 1, 1.5, 2, 3, 4, 6, 8)
MIN_TOKENS_GRID = (128, 256, 512)
# (block_h, block_n, num_warps, num_stages), likeliest first. From sm_90a compiles with Triton 3.6 at page 64: 5
# stages double-buffer the tile and 7 triple-buffer it, <= 4 do not overlap load and math (see DecodeConfig). Left
# out: over 227 KB of shared memory (block_n 64 at 7 stages for 16 heads; at 5+ stages for block_h 64), spills
# (block_h 32 / 64 with 4 warps; block_h 64, block_n 64 at 3 stages).
FEW_HEADS_TILES = [
    (16, 32, 4, 5), (16, 16, 4, 5), (16, 16, 4, 7), (16, 64, 4, 5), (16, 32, 8, 5), (16, 16, 8, 5), (16, 64, 8, 5),
    (16, 32, 4, 7), (16, 32, 8, 7), (16, 16, 8, 7), (16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 8, 2), (16, 16, 4, 2),
    (16, 32, 8, 2), (16, 32, 4, 3), (16, 16, 4, 3), (16, 64, 4, 3)]
MANY_HEADS_TILES = [
    (64, 32, 8, 5), (64, 16, 8, 7), (64, 16, 8, 5), (64, 32, 8, 7), (64, 32, 8, 2), (64, 64, 8, 2), (64, 16, 8, 2),
    (64, 32, 8, 3), (32, 32, 8, 5), (32, 64, 8, 5), (32, 16, 8, 7), (32, 32, 8, 2), (16, 32, 4, 5), (16, 16, 4, 5),
    (16, 32, 8, 5)]


def matmul_rate(iters: int) -> float:
    """bf16 (4096 x 7168) @ (7168 x 2048), FLOP/s (the matmul rate the attention is compared with)."""
    a = torch.randn(4096, 7168, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(7168, 2048, dtype=torch.bfloat16, device="cuda")
    return 2 * 4096 * 7168 * 2048 / cuda_time(lambda: a @ b, iters, 5)


def decode_inputs(batch: int, heads: int, ctx: int, page_size: int, seed: int = 0, fill: bool = True):
    """Every sequence at ctx tokens; pages of the pool handed out in random order. fill=False: the same shapes,
    dtypes and strides (so the same compiled kernels), contents uninitialised, and no kernel launched."""
    pages_per_seq = -(-ctx // page_size)
    num_pages = batch * pages_per_seq
    shapes = dict(kv=(num_pages * page_size, R + P), q_lat=(batch, heads, R), q_pe=(batch, heads, P))
    if not fill:
        kv, q_lat, q_pe = (torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes.values())
        table = torch.empty(batch, pages_per_seq, dtype=torch.int64, device="cuda")
        return q_lat, q_pe, kv, table, torch.empty(batch, dtype=torch.int64, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv, q_lat, q_pe = (torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16) for s in shapes.values())
    table = torch.randperm(num_pages, generator=gen, device="cuda").view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    return q_lat, q_pe, kv, table, seq_lens


def reference(inputs, page_size: int) -> torch.Tensor:
    """fp32 torch reference output (B, H, R)."""
    from pdserve.kernels.attention import TorchAttention

    q_lat, q_pe, kv, table, seq_lens = inputs
    return TorchAttention().mla_decode(q_lat.float(), q_pe.float(), kv, table, seq_lens, page_size, SCALE)


def max_row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ||out - ref|| / ||ref|| over (sequence, head) rows; NaN anywhere gives inf."""
    diff = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-6)
    return float(torch.nan_to_num(diff, nan=float("inf")).max())


def graph_time(fn, calls: int, replays: int) -> float:
    """Seconds per call: `calls` calls of fn captured in one CUDA graph, median of `replays` timed replays (no host
    launch cost). fn must have run once already (compiled, planned)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    del graph
    torch.cuda.empty_cache()  # hand the graph's private memory pool back before the next candidate's
    return sorted(times)[len(times) // 2]


def triton_runner(inputs, page_size: int, config=None, num_splits: Optional[int] = None):
    from pdserve.kernels.triton_mla_decode import mla_decode

    q_lat, q_pe, kv, table, seq_lens = inputs
    out = torch.empty_like(q_lat)
    return lambda: mla_decode(q_lat, q_pe, kv, table, seq_lens, page_size, SCALE, out=out, num_splits=num_splits,
                              config=config)


def flashinfer_runner(inputs, page_size: int, graph: bool):
    """graph=True: the CUDA-graph form of the wrapper (fixed index buffers; the same kernel)."""
    from pdserve.kernels import flashinfer_attention

    q_lat, q_pe, kv, table, seq_lens = inputs
    shapes = dict(graph_batch_size=q_lat.shape[0], max_pages=table.shape[1]) if graph else {}
    dec = flashinfer_attention.FlashInferMLADecode(q_lat.device, **shapes)
    dec.plan(table, seq_lens, q_lat.shape[1], page_size, SCALE, q_lat.dtype, kv.dtype)  # once: run() is timed
    out = torch.empty_like(q_lat)
    return lambda: dec.run(q_lat, q_pe, kv, out=out)


def rates(seconds: float, batch: int, heads: int, ctx: int, copy_bw: float, mm_rate: float) -> dict:
    kv_bytes = batch * ctx * (R + P) * 2
    r = dict(time_ms=seconds * 1e3, achieved_gb_s=kv_bytes / seconds / 1e9,
             fraction_of_copy_bw=kv_bytes / seconds / copy_bw)
    if heads >= 128:
        flops = 2 * batch * heads * ctx * ((R + P) + R)
        r.update(tflop_s=flops / seconds / 1e12, fraction_of_matmul=flops / seconds / mm_rate)
    return r


def row(name: str, args, heads: int, copy_bw: float, mm_rate: float, eager: Optional[float],
        graph: Optional[float], **extra) -> dict:
    """Eager rates at the top level (as in earlier results), graph rates under "graph"."""
    r = dict(backend=name, batch=args.batch, heads=heads, ctx=args.ctx, page_size=args.page_size,
             kv_bytes_per_call=args.batch * args.ctx * (R + P) * 2)
    if eager is not None:
        r.update(rates(eager, args.batch, heads, args.ctx, copy_bw, mm_rate))
    r["graph"] = None if graph is None else rates(graph, args.batch, heads, args.ctx, copy_bw, mm_rate)
    r.update(extra)
    return r


# ---- sweep ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Candidate:
    heads: int
    tile: tuple  # DecodeConfig's first fields: (block_h, block_n, num_warps, num_stages)
    splits: dict  # split count -> the (programs_per_sm, min_tokens_per_split) knobs that give it


def current_default(heads: int) -> tuple[tuple, tuple]:
    """(tile, knobs) of the module's default config for bf16 at this head count."""
    from pdserve.kernels.triton_mla_decode import default_decode_config

    cfg = default_decode_config(torch.bfloat16, heads)
    return tuple(getattr(cfg, f) for f in TILE_FIELDS), (cfg.programs_per_sm, cfg.min_tokens_per_split)


def split_knobs() -> list[tuple]:
    return [(p, m) for p in PROGRAMS_PER_SM_GRID for m in MIN_TOKENS_GRID]


def candidates(args, heads: int, sms: int) -> list[Candidate]:
    from pdserve.kernels.triton_mla_decode import choose_num_splits

    tiles = [t for t in (MANY_HEADS_TILES if heads >= 64 else FEW_HEADS_TILES) if t[0] <= max(16, heads)]
    default_tile, default_knobs = current_default(heads)
    if default_tile not in tiles:
        tiles.insert(1, default_tile)
    pages = -(-args.ctx // args.page_size)
    out = []
    for tile in tiles:
        splits: dict = {}
        for pps, mt in [default_knobs] + [k for k in split_knobs() if k != default_knobs]:
            s = choose_num_splits(args.batch, heads, pages, args.page_size, tile[0], sms, programs_per_sm=pps,
                                  min_tokens_per_split=mt)
            splits.setdefault(s, []).append((pps, mt))
        out.append(Candidate(heads, tile, splits))
    return out


@functools.lru_cache(maxsize=1)
def _empty_inputs(batch: int, heads: int, ctx: int, page_size: int):
    return decode_inputs(batch, heads, ctx, page_size, fill=False)


def _compile_candidate(batch: int, heads: int, ctx: int, page_size: int, tile: tuple,
                       splits: list[int]) -> Optional[str]:
    """In a worker process: compile a candidate for each split count (compile_only launches nothing). -> error"""
    from pdserve.kernels.triton_mla_decode import DecodeConfig, mla_decode

    try:
        q_lat, q_pe, kv, table, seq_lens = _empty_inputs(batch, heads, ctx, page_size)
        for s in splits:
            mla_decode(q_lat, q_pe, kv, table, seq_lens, page_size, SCALE, config=DecodeConfig(*tile), num_splits=s,
                       compile_only=True)
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def _build_flashinfer(page_size: int) -> Optional[str]:
    """In a worker process: FlashInfer's first plan() JIT-builds its MLA module (30-60 s on a fresh machine) into
    the on-disk cache that this process then loads. -> error"""
    try:
        from pdserve.kernels import flashinfer_attention

        table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
        dec = flashinfer_attention.FlashInferMLADecode(table.device)
        dec.plan(table, torch.ones(1, dtype=torch.int32, device="cuda"), 16, page_size, SCALE, torch.bfloat16,
                 torch.bfloat16)
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def measure_backend(name: str, args, heads: int, inputs, ref, copy_bw: float, mm_rate: float,
                    skipped: dict) -> Optional[dict]:
    """The main row of one backend at its defaults: eager and graph timings, error against the reference."""
    try:  # a backend that fails here (e.g. FlashInfer's JIT build) is reported, not fatal
        fn = triton_runner(inputs, args.page_size) if name == "triton" else flashinfer_runner(
            inputs, args.page_size, graph=False)
        err = max_row_rel_err(fn(), ref)
        eager = cuda_time(fn, args.iters, args.warmup)
    except Exception as exc:
        skipped[f"{name}@{heads}heads"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"{name} at {heads} heads failed: {skipped[f'{name}@{heads}heads']}", flush=True)
        return None
    try:
        graph = graph_time(fn if name == "triton" else flashinfer_runner(inputs, args.page_size, graph=True),
                           args.graph_calls, args.graph_replays)
    except Exception as exc:
        skipped[f"{name}@{heads}heads graph"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        graph = None
    print(f"{name} {heads} heads: {eager * 1e3:.3f} ms eager, " + (f"{graph * 1e3:.3f} ms graph" if graph else
          "graph failed") + f", rel err {err:.1e}", flush=True)
    return row(name, args, heads, copy_bw, mm_rate, eager, graph, rel_err_vs_reference=err)


def sweep_heads(args, heads: int, inputs, ref, cands: list[Candidate], compiled: dict, deadline: float,
                sms: int, copy_bw: float, mm_rate: float, log: dict) -> list[dict]:
    """Times each candidate at each of its split counts until the deadline; what is left goes to log["skipped"]."""
    from pdserve.kernels.triton_mla_decode import DecodeConfig

    rows = []
    for i, cand in enumerate(cands):
        if time.monotonic() > deadline:
            log["skipped"] += [f"{heads} heads {c.tile} splits {sorted(c.splits)}" for c in cands[i:]]
            break
        pending = compiled.get((heads, cand.tile))
        if pending is not None:  # wait for the worker (or compile here if it is late)
            try:
                err = pending.get(timeout=max(0.1, min(deadline - time.monotonic(), 60.0)))
                if err:
                    log["precompile_errors"].append(f"{heads} heads {cand.tile}: {err}")
            except multiprocessing.TimeoutError:
                pass
        for split, knobs in cand.splits.items():
            if time.monotonic() > deadline:
                log["skipped"].append(f"{heads} heads {cand.tile} splits {split}")
                continue
            try:
                fn = triton_runner(inputs, args.page_size, DecodeConfig(*cand.tile), split)
                err = max_row_rel_err(fn(), ref)  # first call: compile, or load from the cache
                seconds = graph_time(fn, args.sweep_calls, args.sweep_replays)
            except Exception as exc:  # e.g. out of shared memory: the other split counts would fail alike
                log["errors"].append(f"{heads} heads {cand.tile} splits {split}: {type(exc).__name__}: "
                                     f"{str(exc)[:200]}")
                print(f"  sweep {heads} heads {cand.tile} splits {split}: {type(exc).__name__}: {str(exc)[:120]}")
                break
            programs = args.batch * -(-heads // cand.tile[0]) * split
            rows.append(row("triton-sweep", args, heads, copy_bw, mm_rate, None, seconds,
                            config=dict(zip(TILE_FIELDS, cand.tile)), num_splits=split,
                            knobs=[list(k) for k in knobs], programs_per_sm=programs / sms,
                            rel_err_vs_reference=err))
    return rows


def recommend(sweep_rows: list[dict], heads_list: list[int], args, sms: int) -> Optional[dict]:
    """Per head class (FEW_HEADS_CONFIG: < 64 heads, MANY_HEADS_CONFIG: >= 64), the tile and split knobs whose
    measured times are best: the geometric mean over the class's head counts of time / that head count's best sweep
    time. Only measured combinations count; the current default stays unless MARGIN slower than the best."""
    from pdserve.kernels.triton_mla_decode import choose_num_splits

    times = {}
    for r in sweep_rows:
        if r["rel_err_vs_reference"] <= MAX_REL_ERR:
            times[(r["heads"], tuple(r["config"][k] for k in TILE_FIELDS), r["num_splits"])] = r["graph"]["time_ms"]
    best = {h: min((t for (hh, _, _), t in times.items() if hh == h), default=None) for h in heads_list}
    pages = -(-args.ctx // args.page_size)
    out = dict(lines=[], per_heads={})
    for name, hs in (("FEW_HEADS_CONFIG", [h for h in heads_list if h < 64 and best[h]]),
                     ("MANY_HEADS_CONFIG", [h for h in heads_list if h >= 64 and best[h]])):
        if not hs:
            continue
        scored = {}  # (tile, knobs) -> (score, {heads: (splits, ms)})
        for tile in sorted({tile for (h, tile, _) in times if h in hs}):
            for pps, mt in split_knobs() + [current_default(hs[0])[1]]:
                per = {}
                for h in hs:
                    split = choose_num_splits(args.batch, h, pages, args.page_size, tile[0], sms, programs_per_sm=pps,
                                              min_tokens_per_split=mt)
                    if (h, tile, split) in times:
                        per[h] = (split, times[(h, tile, split)])
                if len(per) == len(hs):
                    scored[(tile, (pps, mt))] = (math.prod(per[h][1] / best[h] for h in hs) ** (1 / len(hs)), per)
        if not scored:
            continue
        default = current_default(hs[0])
        (_, (dp, dm)) = default  # equal scores (the same split counts): the knobs nearest the current ones
        pick = min(scored, key=lambda k: (scored[k][0], abs(math.log(k[1][0] / dp)), abs(math.log(k[1][1] / dm))))
        if default in scored and scored[default][0] <= scored[pick][0] * (1 + MARGIN):
            pick = default
        (tile, (pps, mt)), per = pick, scored[pick][1]
        out["lines"] += [f"{name} = DecodeConfig(block_h={tile[0]}, block_n={tile[1]}, num_warps={tile[2]}, "
                         f"num_stages={tile[3]},",
                         f"{' ' * (len(name) + 16)}programs_per_sm={pps}, min_tokens_per_split={mt})"]
        for h, (split, ms) in per.items():
            out["per_heads"][h] = dict(constant=name, tile=list(tile), programs_per_sm=pps, min_tokens_per_split=mt,
                                       num_splits=split, graph_time_ms=ms, vs_best_sweep=ms / best[h],
                                       unchanged=pick == default)
    return out if out["lines"] else None


# ---- main -------------------------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=4096, help="tokens per sequence (batch * ctx >= 256k by default)")
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--iters", type=int, default=50, help="eager timing: timed calls")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--graph-calls", type=int, default=20, help="calls captured per CUDA graph (main rows)")
    p.add_argument("--graph-replays", type=int, default=7)
    p.add_argument("--sweep", action="store_true", help="also time triton tile configs and split counts")
    p.add_argument("--sweep-calls", type=int, default=10, help="calls per CUDA graph in the sweep")
    p.add_argument("--sweep-replays", type=int, default=5)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-clock budget from start-up: no new sweep candidate is tried after it")
    p.add_argument("--compile-workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                   help="processes compiling sweep candidates ahead of the timing (0: compile in this one)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_decode needs a CUDA GPU")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter is for CPU tests")
    from pdserve.kernels import flashinfer_attention

    deadline = START + (args.time_budget_s if args.time_budget_s is not None else math.inf)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    backends = [n for n, ok in (("triton", triton_installed()),
                                ("flashinfer", flashinfer_attention.flashinfer is not None)) if ok]
    skipped = {} if flashinfer_attention.flashinfer is not None else {
        "flashinfer": flashinfer_attention.FLASHINFER_IMPORT_ERROR}
    sweeping = args.sweep and "triton" in backends
    cands = {h: candidates(args, h, sms) for h in args.heads} if sweeping else {}
    pool, compiled, fi_build = None, {}, None
    if sweeping and args.compile_workers > 0:  # compile while this process measures
        try:
            pool = multiprocessing.get_context("spawn").Pool(args.compile_workers)
            if "flashinfer" in backends:  # FlashInfer's JIT build first: the longest job
                fi_build = pool.apply_async(_build_flashinfer, (args.page_size,))
            for h in args.heads:
                for c in cands[h]:
                    compiled[(h, c.tile)] = pool.apply_async(
                        _compile_candidate, (args.batch, h, args.ctx, args.page_size, c.tile, sorted(c.splits)))
        except Exception as exc:  # no workers: each candidate compiles here when its turn comes
            print(f"compile workers unavailable ({type(exc).__name__}: {exc}); compiling in this process")

    copy_bw, mm_rate = copy_bandwidth(args.iters, 2 << 30), matmul_rate(args.iters)
    print(f"{torch.cuda.get_device_name()} ({sms} SMs): copy {copy_bw / 1e12:.2f} TB/s (read + write), "
          f"bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s; backends: {', '.join(backends)}"
          + (f" (flashinfer skipped: {skipped['flashinfer']})" if skipped else ""), flush=True)

    rows, inputs, refs = [], {}, {}
    for heads in args.heads:
        inputs[heads] = decode_inputs(args.batch, heads, args.ctx, args.page_size)
        refs[heads] = reference(inputs[heads], args.page_size)
        if "triton" in backends:
            rows.append(measure_backend("triton", args, heads, inputs[heads], refs[heads], copy_bw, mm_rate,
                                        skipped))

    log = dict(skipped=[], errors=[], precompile_errors=[])
    sweep_rows, rec = [], None
    if sweeping:  # FlashInfer (the reference) is timed after, so its JIT build overlaps the sweep
        t0 = time.monotonic()
        sweep_deadline = deadline - (RESERVE_S if "flashinfer" in backends else 0)
        for i, heads in enumerate(args.heads):  # an equal share of what is left per head count
            share = (sweep_deadline - time.monotonic()) / (len(args.heads) - i)
            sweep_rows += sweep_heads(args, heads, inputs[heads], refs[heads], cands[heads], compiled,
                                      time.monotonic() + share, sms, copy_bw, mm_rate, log)
        log["sweep_s"] = time.monotonic() - t0
        rec = recommend(sweep_rows, args.heads, args, sms)
        if rec is not None:  # the recommended combinations eagerly too, beside flashinfer's eager time
            from pdserve.kernels.triton_mla_decode import DecodeConfig

            for h, pick in rec["per_heads"].items():  # the config as pasted: its knobs give the split count
                cfg = DecodeConfig(*pick["tile"], programs_per_sm=pick["programs_per_sm"],
                                   min_tokens_per_split=pick["min_tokens_per_split"])
                fn = triton_runner(inputs[h], args.page_size, cfg)
                rows.append(row("triton-recommended", args, h, copy_bw, mm_rate, cuda_time(fn, args.iters, 3),
                                pick["graph_time_ms"] / 1e3, config=dataclasses.asdict(cfg),
                                num_splits=pick["num_splits"]))
        print_sweep(sweep_rows, rec, log, args)
        if "flashinfer" in backends:  # written now too, in case FlashInfer's build outlasts the caller's timeout
            write_json(args, rows, sweep_rows, dict(log, recommendation=rec), sms, copy_bw, mm_rate, skipped,
                       partial=True)
    if "flashinfer" in backends:
        if fi_build is not None:
            try:
                build_err = fi_build.get(timeout=None if math.isinf(deadline) else
                                         max(5.0, deadline + 30 - time.monotonic()))
                if build_err:
                    print(f"flashinfer build in a worker failed ({build_err}); building here")
            except multiprocessing.TimeoutError:
                print("flashinfer build in a worker still running; waiting for it here")
        for heads in args.heads:
            rows.append(measure_backend("flashinfer", args, heads, inputs[heads], refs[heads], copy_bw, mm_rate,
                                        skipped))
    if pool is not None:
        pool.terminate()
        pool.join()
    rows = [r for r in rows if r is not None]
    order = {"triton": 0, "flashinfer": 1, "triton-recommended": 2}
    rows.sort(key=lambda r: (r["heads"], order.get(r["backend"], 3)))
    print_main(rows, sweep_rows, args)
    write_json(args, rows, sweep_rows, dict(log, recommendation=rec) if sweeping else None, sms, copy_bw, mm_rate,
               skipped, partial=False)


def write_json(args, rows: list[dict], sweep_rows: list[dict], sweep: Optional[dict], sms: int, copy_bw: float,
               mm_rate: float, skipped: dict, partial: bool) -> None:
    from pdserve.kernels import flashinfer_attention

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv), gpu=torch.cuda.get_device_name(), sms=sms,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__, triton=triton_version,
        flashinfer=getattr(flashinfer_attention.flashinfer, "__version__", None), skipped=skipped,
        copy_bandwidth_bytes_s=copy_bw, bf16_matmul_flop_s=mm_rate, rows=[r for r in rows if r] + sweep_rows,
        sweep=None if sweep is None else dict(sweep, time_budget_s=args.time_budget_s),
        partial=partial, elapsed_s=time.monotonic() - START)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}{' (partial: flashinfer rows to come)' if partial else ''} after "
          f"{time.monotonic() - START:.0f} s", flush=True)


def show(r: dict) -> None:
    g = r["graph"] or {}
    extra = {k: r[k] for k in ("config", "num_splits", "programs_per_sm", "rel_err_vs_reference") if k in r}
    if "config" in extra:
        extra["config"] = tuple(extra["config"].values())
    for k in ("programs_per_sm", "rel_err_vs_reference"):
        if k in extra:
            extra[k] = float(f"{extra[k]:.2g}")
    print(f"{r['backend']:<19}{r['heads']:>5}" + (f"{r['time_ms']:>9.3f}" if "time_ms" in r else " " * 9)
          + (f"{g['time_ms']:>9.3f}{g['achieved_gb_s']:>8.0f}{100 * g['fraction_of_copy_bw']:>6.0f}%" if g
             else " " * 24)
          + (f"{g['tflop_s']:>9.0f}{100 * g['fraction_of_matmul']:>5.0f}%" if "tflop_s" in g else " " * 15)
          + f"  {extra}")


def header(args) -> None:
    print(f"\nB={args.batch} ctx={args.ctx} page={args.page_size}; graph: kernel time from CUDA-graph replays")
    print(f"{'backend':<19}{'H':>5}{'eager ms':>9}{'graph ms':>9}{'GB/s':>8}{'%copy':>7}{'TFLOP/s':>9}{'%mm':>6}"
          "  extra")


def ranked(sweep_rows: list[dict], heads: int) -> list[dict]:
    """The accurate sweep points of one head count, fastest first."""
    return sorted((r for r in sweep_rows if r["heads"] == heads and r["rel_err_vs_reference"] <= MAX_REL_ERR),
                  key=lambda r: r["graph"]["time_ms"])


def print_sweep(sweep_rows: list[dict], rec: Optional[dict], log: dict, args) -> None:
    header(args)
    for heads in args.heads:
        top = ranked(sweep_rows, heads)
        print(f"-- {heads} heads: the 5 fastest of {len(top)} accurate sweep points")
        for r in top[:5]:
            show(r)
    inaccurate = [r for r in sweep_rows if not r["rel_err_vs_reference"] <= MAX_REL_ERR]
    if inaccurate:
        print(f"{len(inaccurate)} sweep points over the relative error {MAX_REL_ERR} (left out; in the JSON)")
    if log["errors"]:
        print(f"{len(log['errors'])} sweep points failed (see the JSON's sweep.errors)")
    if log["skipped"]:
        print(f"time budget spent: {len(log['skipped'])} candidates not tried:")
        for s in log["skipped"]:
            print(f"  {s}")
    if rec is None:
        print("no recommendation: no head count has an accurate sweep point at every split knob tried")
        return
    per = ", ".join(f"{h} heads {v['graph_time_ms']:.3f} ms ({v['num_splits']} splits, {v['vs_best_sweep']:.2f}x "
                    f"its best{', the current default' if v['unchanged'] else ''})"
                    for h, v in rec["per_heads"].items())
    print(f"\nPaste into kernels/triton_mla_decode.py ({per}):")
    for line in rec["lines"]:
        print(f"    {line}")


def print_main(rows: list[dict], sweep_rows: list[dict], args) -> None:
    header(args)
    for r in rows:
        show(r)
    for heads in args.heads:  # best triton against flashinfer, both graph-timed (and eager where both were)
        by = {r["backend"]: r for r in rows if r["heads"] == heads}
        top = ranked(sweep_rows, heads)
        fi = by.get("flashinfer")
        parts = []
        if by.get("triton") and by["triton"]["graph"]:
            parts.append(f"triton default {by['triton']['graph']['time_ms']:.3f}")
        if top:
            parts.append(f"best sweep {top[0]['graph']['time_ms']:.3f} ({tuple(top[0]['config'].values())}, "
                         f"{top[0]['num_splits']} splits)")
        if fi and fi["graph"]:
            parts.append(f"flashinfer {fi['graph']['time_ms']:.3f}")
            best = top[0]["graph"]["time_ms"] if top else (by.get("triton") or {}).get("graph", {}).get("time_ms")
            if best:
                parts.append(f"triton / flashinfer = {best / fi['graph']['time_ms']:.2f}")
        print(f"SUMMARY {heads} heads, graph ms: " + "; ".join(parts))
        rec = by.get("triton-recommended")
        if fi and rec:
            print(f"SUMMARY {heads} heads, eager ms: triton recommended {rec['time_ms']:.3f}; flashinfer "
                  f"{fi['time_ms']:.3f}; triton / flashinfer = {rec['time_ms'] / fi['time_ms']:.2f}")


if __name__ == "__main__":
    main()
