"""NextN speculative decoding on a GPU: acceptance, decode tokens/s with and without speculation, the cost of a
draft step, bf16 divergence analysis (trained model); draft and verify overhead on a DeepSeek-V3 slice.

    python benchmarks/bench_spec.py --model models/tiny-trained --out spec.json [--batch 1 8 32] [--steps 3]

Trained model (bf16, CUDA graphs over decode, draft steps, verification and draft extend):
  - decode tokens/s at each batch size, speculation off and on (k = --steps), over held-out prompts
    (files the training never saw, when run with the Python that trained the model); time to the first token is
    excluded: the clock starts when every request has its first token; plain and NextN alternate --repeats times
    and the medians are reported, next to the speed-up of each side-by-side pair;
  - mean accepted tokens per verification step;
  - one draft step (MTP graph replay) vs one target decode step (graph replay) at the same batch size;
  - greedy identity, speculation on vs off, per prompt; at every first divergence, the target's top-2 logit gap in
    fp32 next to the bf16-vs-fp32 logit error at that position ("within bf16 rounding" when gap <= error).
V3 slice (FP8 dummy weights, --v3-layers layers + NextN): per batch size, graph replay times of one decode step
(B rows), one verification pass (B*(k+1) rows), one draft step (B rows), and the per-round overhead ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from benchmarks.bench_one_batch import decode_batch, v3_slice  # noqa: E402
from benchmarks.timing import cuda_time  # noqa: E402
from pdserve.cuda_graph import CudaGraphConfig, DecodeGraphRunner  # noqa: E402
from pdserve.engine import EngineConfig, LLMEngine  # noqa: E402
from pdserve.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from pdserve.kernels import KernelBackends  # noqa: E402
from pdserve.kv_cache import CacheConfig, LatentKVPool  # noqa: E402
from pdserve.sampling import SamplingParams  # noqa: E402
from pdserve.scheduler import SchedulerConfig  # noqa: E402
from pdserve.spec_decode import SpeculativeConfig  # noqa: E402
from pdserve.weights import load_model  # noqa: E402


DEVICE = "cuda"  # --device; "cpu" only smoke-tests the script (no graphs, no timings worth reporting)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[spec] {msg}", flush=True)


def held_out_prompts(model_dir: str, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens cut from the held-out split of scripts/train_tiny.py's corpus."""
    from tokenizers import Tokenizer
    from train_tiny import load_corpus

    _, held = load_corpus(4_000_000)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = [i for text in held for i in tok.encode(text).ids]
    stride = max(length, (len(ids) - length) // max(n, 1))
    return [ids[i * stride: i * stride + length] for i in range(n)]


def engine(args, speculate: bool, dtype: str = "bfloat16", graphs: bool = True, max_bs: int = 32) -> LLMEngine:
    return LLMEngine(EngineConfig(
        args.model, dtype=dtype, device=DEVICE, attention_backend=args.attention_backend,
        moe_backend=args.moe_backend, gemm_backend="torch",
        cache=CacheConfig(page_size=16, num_pages=4096),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_running_requests=max(max_bs, 1)),
        cuda_graph=CudaGraphConfig(enabled=graphs, max_bs=max_bs),
        speculative=SpeculativeConfig("NEXTN", args.steps) if speculate else SpeculativeConfig()),
        progress=lambda _: None)


def decode_run(eng: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, int]:
    """Greedy generation; returns (outputs, decode seconds, tokens emitted in that time). The clock starts once
    every request has its first token, so prefill is excluded."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {i: [] for i in ids}

    def step() -> int:
        n = 0
        for o in eng.step():
            outputs[o.request_id] += o.new_token_ids
            n += len(o.new_token_ids)
        return n

    while any(not v for v in outputs.values()):
        step()
    sync()
    start, emitted = time.perf_counter(), 0
    while eng.has_unfinished:
        emitted += step()
    sync()
    assert eng.kv_pages_in_use_by_requests() == 0, "pages still held after the run"
    return [outputs[i] for i in ids], time.perf_counter() - start, emitted


def bench_trained(args) -> dict:
    prompts = held_out_prompts(args.model, max(max(args.batch), args.divergence_prompts, args.min_prompts),
                               args.prompt_len)
    result: dict = {"batches": []}
    for b in args.batch:
        # Small batches run several groups of prompts one after the other, so acceptance is not one prompt's.
        groups = [prompts[i * b:(i + 1) * b] for i in range(max(1, args.min_prompts // b))]
        row = {"batch": b, "prompts": b * len(groups)}
        engines = {False: engine(args, False, max_bs=b), True: engine(args, True, max_bs=b)}
        for eng in engines.values():
            decode_run(eng, groups[0], 8)  # warm-up (autotuning, allocator)
        spec = engines[True].speculator
        spec.num_rows = spec.num_emitted = spec.num_drafted = spec.num_chained_ahead = 0
        # Plain and NextN alternate, --repeats times: the host's speed drifts between and within machines, and the
        # speed-up is only meaningful between runs made side by side. Reported: the median of each.
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for speculate, eng in engines.items():
                seconds = emitted = 0
                for group in groups:
                    _, s, e = decode_run(eng, group, args.new_tokens)
                    seconds, emitted = seconds + s, emitted + e
                runs[speculate].append(emitted / seconds)
        row["plain_tok_s_runs"], row["spec_tok_s_runs"] = runs[False], runs[True]
        row["plain_tok_s"], row["spec_tok_s"] = statistics.median(runs[False]), statistics.median(runs[True])
        row["speedup_runs"] = [s / p for p, s in zip(runs[False], runs[True])]
        row["accept_length"] = spec.mean_accept_length
        row["rounds_chained_ahead"] = spec.num_chained_ahead
        row.update(stage_times(engines[True], b, args.steps))
        del engines, spec
        free_memory()
        row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        log(f"B={b:3d} ({row['prompts']} prompts): plain {row['plain_tok_s']:9.1f} tok/s, NextN k={args.steps} "
            f"{row['spec_tok_s']:9.1f} tok/s ({row['speedup']:.2f}x), accept length {row['accept_length']:.2f}; "
            f"GPU: target step {row['target_step_ms']:.3f} ms, draft step {row['draft_step_ms']:.3f} ms "
            f"({row['draft_over_target']:.2f}), round {row['round_gpu_ms']:.3f} ms = verify {row['verify_ms']:.3f} + "
            f"chain {row['chain_ms']:.3f} + extend {row['extend_ms']:.3f}; GPU-only bound on the speed-up "
            f"{row['gpu_bound_speedup']:.2f}x; speed-up per repeat "
            f"{' '.join(f'{x:.2f}' for x in row['speedup_runs'])}")
        result["batches"].append(row)
    result["divergence"] = divergence(args, prompts[: args.divergence_prompts])
    if args.profile:
        profile_round(args, prompts[:1])
    if args.timeline:
        result["timeline"] = timeline(args, prompts[:1])
    if args.host_phases:
        result["host_phases"] = host_phases(args, prompts[:2])
    return result


def stage_times(eng: LLMEngine, b: int, k: int) -> dict:
    """Graph replay times of one plain step and of a round's stages at batch b: the verification (b*(k+1) rows),
    the chained drafts d_2..d_k (b rows) and the draft extend (timed at its largest, b*(k+1) rows)."""
    if DEVICE != "cuda":
        return dict.fromkeys(("target_step_ms", "draft_step_ms", "draft_over_target", "verify_ms", "chain_ms",
                              "extend_ms", "round_gpu_ms", "gpu_bound_speedup"), float("nan"))
    g, d = eng.runner.graphs, eng.runner.mtp_graphs
    assert g is not None and d is not None, "graphs were not captured with speculation on"

    def bucket(graphs, rows):
        return graphs.graphs[min(x for x in graphs.graphs if x >= rows)]

    t = dict(target_step_ms=cuda_time(bucket(g, b).graph.replay, iters=50) * 1e3,
             draft_step_ms=cuda_time(bucket(d, b).graph.replay, iters=50) * 1e3,
             verify_ms=cuda_time(bucket(g, b * (k + 1)).graph.replay, iters=50) * 1e3,
             chain_ms=cuda_time(bucket(d, b).chain.replay, iters=50) * 1e3 if k > 1 else 0.0,
             extend_ms=cuda_time(bucket(d, b * (k + 1)).graph.replay, iters=50) * 1e3)
    t["draft_over_target"] = t["draft_step_ms"] / t["target_step_ms"]
    t["round_gpu_ms"] = t["verify_ms"] + t["chain_ms"] + t["extend_ms"]
    accept = eng.speculator.mean_accept_length
    t["gpu_bound_speedup"] = accept * t["target_step_ms"] / t["round_gpu_ms"]  # no host time on either side
    return t


def profile_round(args, prompts: list[list[int]]) -> None:
    """Where the host time of speculative decoding at batch 1 goes (cProfile, top functions by own time)."""
    import cProfile
    import pstats

    eng = engine(args, True, max_bs=1)
    decode_run(eng, prompts, 8)
    prof = cProfile.Profile()
    prof.enable()
    _, seconds, emitted = decode_run(eng, prompts, args.new_tokens)
    prof.disable()
    log(f"profile: B=1 NextN {emitted / seconds:.1f} tok/s; top host functions by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def timeline(args, prompts: list[list[int]]) -> dict:
    """Where the wall time goes at batch 1 (torch.profiler, so the host side is a little slower than unprofiled):
    the GPU's busy time (kernels and copies) against the wall clock, for plain decoding and for NextN; the
    difference is the GPU waiting for the host. Also the launches per engine step and the top host ops."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for speculate in (False, True):
        eng = engine(args, speculate, max_bs=1)
        decode_run(eng, prompts, 8)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for p in prompts:
                eng.add_request(p, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
            steps = 0
            while eng.has_unfinished:
                eng.step()
                steps += 1
            sync()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        busy = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e6
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaGraphLaunch",
                                                            "cudaMemcpyAsync", "cudaLaunchKernelExC"))
        name = "nextn" if speculate else "plain"
        out[name] = dict(wall_ms_per_step=wall / steps * 1e3, gpu_busy_ms_per_step=busy / steps * 1e3,
                         gpu_idle_fraction=1 - busy / wall, launches_per_step=launches / steps, steps=steps)
        log(f"timeline B=1 {name}: {steps} steps, {wall / steps * 1e3:.3f} ms/step wall, GPU busy "
            f"{busy / steps * 1e3:.3f} ms/step ({100 * busy / wall:.0f}%), {launches / steps:.1f} launches and "
            "copies per step; top host ops by self time:")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
            log(f"  {e.key[:60]:60s} {e.count / steps:6.1f}/step {e.self_cpu_time_total / steps:8.1f} us/step")
        del eng
        free_memory()
    return out


def host_phases(args, prompts: list[list[int]]) -> dict:
    """Host time per engine step at batch 1, by phase (wall-clock wrappers, no profiler): where the host spends a
    round, and how long it blocks on the GPU (the device-to-host read: time the GPU was the bottleneck)."""
    from pdserve.cuda_graph import DecodeGraphRunner
    from pdserve.engine import LLMEngine as Engine
    from pdserve.model_runner import ModelRunner
    from pdserve.scheduler import Scheduler
    from pdserve.spec_decode import NextNSpeculator

    spent: dict[str, list[float]] = {}

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent.setdefault(label, []).append(time.perf_counter() - t)
        setattr(owner, name, timed)
        return owner, name, fn

    out = {}
    for speculate in (False, True):
        eng = engine(args, speculate, max_bs=1)
        decode_run(eng, prompts, 8)
        spent.clear()
        patched = [wrap(Engine, "step", "engine.step"), wrap(Scheduler, "schedule", "scheduler.schedule"),
                   wrap(Engine, "_append", "engine._append"), wrap(ModelRunner, "pack_rows", "runner.pack_rows"),
                   wrap(DecodeGraphRunner, "replay_packed", "graphs.replay_packed (incl. launch)"),
                   wrap(torch.cuda.CUDAGraph, "replay", "cudaGraphLaunch"),
                   wrap(torch.Tensor, "tolist", "tensor.tolist (blocks on the GPU)"),
                   wrap(NextNSpeculator, "_draft_chain", "spec._draft_chain"),
                   wrap(NextNSpeculator, "_verify_chained", "spec._verify_chained"),
                   wrap(NextNSpeculator, "extend", "spec.extend")]
        try:
            _, seconds, emitted = decode_run(eng, prompts, args.new_tokens)
        finally:
            for owner, name, fn in patched:
                setattr(owner, name, fn)
        steps = len(spent.get("engine.step", [])) or 1
        name = "nextn" if speculate else "plain"
        out[name] = {k: dict(calls_per_step=len(v) / steps, us_per_step=sum(v) / steps * 1e6) for k, v in spent.items()}
        log(f"host phases B=1 {name}: {emitted / seconds:.1f} tok/s, {steps} steps, wall per step "
            f"{out[name]['engine.step']['us_per_step']:.0f} us (engine.step, inclusive):")
        for k, v in sorted(out[name].items(), key=lambda kv: -kv[1]["us_per_step"]):
            log(f"  {k:42s} {v['calls_per_step']:5.1f}/step {v['us_per_step']:8.1f} us/step")
        del eng
        free_memory()
    return out


def last_logits(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The target's fp32 logits (vocab,) after the token sequence `ids` (one prefill forward)."""
    pool = eng.pool
    pages = pool.allocator.alloc(-(-len(ids) // pool.page_size))
    try:
        batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(ids, device=DEVICE),
                             torch.arange(len(ids), device=DEVICE), pool.slots_for(pages, 0, len(ids)).to(DEVICE),
                             pool.page_size, qo_indptr=[0, len(ids)], prefix_lens=[0], page_tables=[pages])
        return eng.model.logits(eng.model(batch, pool.kv)[-1:])[0].float()
    finally:
        pool.allocator.decref(pages)


def divergence(args, prompts: list[list[int]]) -> dict:
    """bf16 + graphs: speculation on vs off, greedy. Each first divergence is explained (or not) by bf16 rounding."""
    plain, _, _ = decode_run(engine(args, False), prompts, args.new_tokens)
    spec, _, _ = decode_run(engine(args, True), prompts, args.new_tokens)
    free_memory()
    bf16, fp32 = engine(args, False, graphs=False), engine(args, False, "float32", graphs=False)
    cases = []
    for p, a, s in zip(prompts, plain, spec):
        if a == s:
            continue
        i = next(j for j, (x, y) in enumerate(zip(a, s)) if x != y)
        ctx = p + a[:i]
        ref, low = last_logits(fp32, ctx), last_logits(bf16, ctx)
        top2 = torch.topk(ref, 2).values
        gap, err = float(top2[0] - top2[1]), float((low - ref).abs().max())
        cases.append(dict(position=i, plain_token=a[i], spec_token=s[i], fp32_top2_gap=gap,
                          bf16_logit_error=err, within_bf16_rounding=gap <= err))
    explained = sum(c["within_bf16_rounding"] for c in cases)
    log(f"bf16 divergence: {len(prompts) - len(cases)}/{len(prompts)} prompts identical over {args.new_tokens} "
        f"tokens; {explained}/{len(cases)} first divergences at an fp32 top-2 gap within the bf16 logit error")
    return dict(prompts=len(prompts), new_tokens=args.new_tokens, identical=len(prompts) - len(cases),
                divergences=cases, explained_by_bf16=explained)


def free_memory() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def bench_v3_slice(args) -> list[dict]:
    cfg = v3_slice(args.v3_layers, fp8=True)
    kernels = KernelBackends.create(args.attention_backend, args.moe_backend, args.v3_gemm_backend)
    model = load_model(None, cfg, torch.bfloat16, kernels, "dummy", "cuda")
    width, ctx, page = args.steps + 1, args.v3_ctx, 64
    sizes = sorted({b for b in args.batch} | {b * width for b in args.batch})
    pool = LatentKVPool(cfg.num_kv_layers, cfg.kv_cache_dim,
                        CacheConfig(page, max(sizes) * (-(-ctx // page)) + 8), torch.bfloat16, "cuda")
    graph_cfg = CudaGraphConfig(batch_sizes=tuple(sizes), max_bs=max(sizes))
    target = DecodeGraphRunner(model, pool, -(-ctx // page), graph_cfg)
    draft = DecodeGraphRunner(model, pool, -(-ctx // page), graph_cfg, mtp=True)
    rows = []
    for b in args.batch:
        plain_rows, wide_rows = decode_batch(pool, b, ctx, "cuda"), decode_batch(pool, b * width, ctx, "cuda")
        hidden = torch.randn(b, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        wide_hidden = hidden.repeat(width, 1)
        decode_ms = cuda_time(lambda: target.run(plain_rows), iters=20) * 1e3
        verify_ms = cuda_time(lambda: target.run(wide_rows), iters=20) * 1e3
        draft_ms = cuda_time(lambda: draft.run(plain_rows, hidden), iters=20) * 1e3
        # A round: k draft steps + the verification + the draft extend (at most B*(k+1) MTP rows; timed at that).
        extend_ms = cuda_time(lambda: draft.run(wide_rows, wide_hidden), iters=20) * 1e3
        round_ms = args.steps * draft_ms + verify_ms + extend_ms
        row = dict(batch=b, ctx=ctx, decode_ms=decode_ms, verify_ms=verify_ms, draft_step_ms=draft_ms,
                   extend_ms=extend_ms, round_ms=round_ms, verify_over_decode=verify_ms / decode_ms,
                   draft_over_decode=draft_ms / decode_ms, breakeven_accept_length=round_ms / decode_ms)
        rows.append(row)
        log(f"V3 slice {args.v3_layers}L B={b:3d} ctx {ctx}: decode {decode_ms:.3f} ms, verify ({b * width} rows) "
            f"{verify_ms:.3f} ms ({row['verify_over_decode']:.2f}x), draft step {draft_ms:.3f} ms "
            f"({row['draft_over_decode']:.2f}x), extend {extend_ms:.3f} ms; a round costs "
            f"{row['breakeven_accept_length']:.2f} decode steps")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--model", default="models/tiny-trained", help="trained checkpoint with an MTP layer")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=3, help="draft steps per round (k)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--min-prompts", type=int, default=8, help="prompts per batch size at least (run in groups)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="alternating plain / NextN runs per batch size")
    p.add_argument("--divergence-prompts", type=int, default=32)
    p.add_argument("--attention-backend", default="triton", help="graph-safe backends: triton, flashinfer (re-planned on the host before each replay)")
    p.add_argument("--moe-backend", default="triton")
    p.add_argument("--v3-layers", type=int, default=4, help="main layers of the V3 slice (0 = skip the slice)")
    p.add_argument("--v3-ctx", type=int, default=1024)
    p.add_argument("--v3-gemm-backend", default="triton")
    p.add_argument("--profile", action="store_true", help="also cProfile speculative decoding at batch 1")
    p.add_argument("--host-phases", action="store_true",
                   help="also time the host's phases per step at batch 1 (wall-clock wrappers)")
    p.add_argument("--timeline", action="store_true",
                   help="also profile GPU busy time vs wall time per step at batch 1 (torch.profiler)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test of the script with the torch backends (no graphs, no V3 slice)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        args.attention_backend = args.moe_backend = "torch"
    result = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), trained=bench_trained(args))
    free_memory()
    if args.v3_layers and DEVICE == "cuda":
        result["v3_slice"] = bench_v3_slice(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
