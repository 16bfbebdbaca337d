"""Workers that span GPUs (issue 45), one table: TP1 vs TP2 vs TP2 + DP attention vs EP2 on the V3 slice (real V3
widths, 4 layers + NextN, block-FP8 dummy weights), each built as `pdserve generate` builds it:

- decode step (ms, through LLMEngine.step in the steady state) at batch 1, 32 and 128, prompts of --decode-ctx tokens;
- prefill tok/s of one prompt of 4k and 16k tokens (one step each, prefix cache off);
- latent-KV capacity in tokens at the same memory fraction: per rank (fraction x the GPU's memory - the rank's
  weights) / KV bytes per token, times the ranks that hold pools of their own (DP attention: all; TP: one copy);
- a 16-layer + NextN V3 configuration (V3's 3 dense layers first; more than one H200 holds) generating through
  `pdserve generate --tp 2`.

On GPUs each configuration runs in a process of its own (its GPU memory returns between them); the parent prints
the table, each issue-45 target met or missed, and writes tp.json and tp.md.

    python benchmarks/bench_tp.py --out DIR                 # two GPUs (bash benchmarks/gpu.sh tp)
    python benchmarks/bench_tp.py --out DIR --dry-run       # the CPU: the demo model, Gloo, tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = {  # name -> the flags of `pdserve generate` that make it
    "tp1": [],
    "tp2": ["--tp", "2"],
    "tp2-dp": ["--tp", "2", "--dp-attention"],
    "ep2": ["--tp", "2", "--ep", "2"],
}


def sizes(args) -> dict:
    """What is measured: the real sizes on GPUs, tiny ones for --dry-run."""
    if args.dry_run:
        return dict(batches=[1, 2, 4], prefill=[32, 64], ctx=8, steps=2, repeats=1)
    return dict(batches=[1, 32, 128], prefill=[4096, 16384], ctx=args.decode_ctx, steps=args.steps, repeats=2)


def engine_flags(args, model_dir: str) -> list[str]:
    s = sizes(args)
    longest = max(s["prefill"])
    # Pages (16 tokens each) for every decoding request whole, each rounded up to whole pages plus one (the step
    # ahead's): a pool short of that preempts requests and recomputes their prompts inside the timed steps.
    per_request = -(-(s["ctx"] + s["steps"] + 8) // 16) + 1
    pages = max(max(s["batches"]) * per_request, -(-(longest + 64) // 16)) + 16
    flags = ["--model", model_dir, "--max-num-batched-tokens", str(longest), "--max-model-len", str(longest + 64),
             "--max-running-requests", str(max(s["batches"])), "--no-prefix-cache",
             "--num-pages", str(pages), "--collective-timeout", "120"]
    if args.dry_run:
        return flags + ["--device", "cpu", "--dtype", "float32"]
    return flags + ["--device", "cuda", "--load-format", "dummy", "--cuda-graph-max-bs", str(max(s["batches"]))]


# ---- one configuration (a child process) ----------------------------------------------------------------------

def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompt(gen, n: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(10, vocab, (n,), generator=gen).tolist()


def profile_steps(engine, steps: int) -> dict:
    """`steps` more engine steps under torch.profiler, rank 0's view (its collectives include waiting for the other
    ranks): time per step (the device's on GPUs, the host's self time on the CPU), the share in the collectives'
    kernels (NCCL; Gloo on the CPU) and the busiest operations."""
    import torch

    cuda = engine.config.device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(engine.config.device)
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    us = {e.key: getattr(e, field, 0) for e in prof.key_averages()}
    total = sum(us.values()) or 1
    collective = sum(t for key, t in us.items() if "nccl" in key.lower() or "gloo" in key.lower())
    top = sorted(us.items(), key=lambda kv: -kv[1])[:12]
    return dict(ms_per_step=total / steps / 1e3, clock="device" if cuda else "host", collective_share=collective / total,
                top=[(key[:90], round(t / steps / 1e3, 4)) for key, t in top])


def print_profile(name: str, what: str, prof: dict, per: str) -> None:
    print(f"[{name}] {what} profiled: {prof['ms_per_step']:.3f} ms of {prof['clock']} time {per}, "
          f"{100 * prof['collective_share']:.0f}% in the collectives; busiest (ms {per}):", flush=True)
    for key, ms in prof["top"]:
        print(f"[{name}]     {ms:8.4f}  {key}", flush=True)


def decode_step_ms(engine, gen, batch: int, ctx: int, steps: int, profile: bool = False) -> tuple[float, dict]:
    """Mean wall ms per engine step once `batch` requests of `ctx`-token prompts all decode (overlap scheduling and
    CUDA graphs as the engine runs them), and what those steps ran: the mean running requests and how many steps
    began with a request waiting (preempted for pages: its prompt recomputed inside the timed steps)."""
    from pdserve.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [engine.add_request(_prompt(gen, ctx, vocab), params) for _ in range(batch)]
    got = dict.fromkeys(ids, 0)
    while min(got.values()) < 3:  # prompts done, the first decode steps (warm-up) too
        for o in engine.step():
            got[o.request_id] += len(o.new_token_ids)
    _sync(engine.config.device)
    running = waiting = 0
    start = time.perf_counter()
    for _ in range(steps):
        running += len(engine.scheduler.running)
        waiting += bool(engine.scheduler.waiting)
        engine.step()
    _sync(engine.config.device)
    took = (time.perf_counter() - start) / steps
    ran = dict(mean_running=running / steps, steps_with_waiting=waiting)
    if profile:
        ran["profile"] = profile_steps(engine, min(steps, 8))  # (their requests still have tokens to make)
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished:
        engine.step()
    return took * 1e3, ran


def prefill_tok_s(engine, gen, n: int, repeats: int, profile: bool = False) -> tuple[float, Optional[dict]]:
    """Tokens per second of one n-token prompt prefilled in one step (the first run warms up, best of the rest);
    with profile, one more prompt's steps under the profiler (rank 0's view, as profile_steps)."""
    from pdserve.sampling import SamplingParams

    def one_prompt() -> None:
        engine.add_request(_prompt(gen, n, engine.model_config.vocab_size), SamplingParams(max_new_tokens=1))

    best = float("inf")
    for k in range(repeats + 1):
        one_prompt()
        _sync(engine.config.device)
        start = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        _sync(engine.config.device)
        if k:
            best = min(best, time.perf_counter() - start)
    prof = None
    if profile:
        one_prompt()
        steps = 0
        while engine.has_unfinished:  # (the steps one prompt takes: its prefill, the overlap's read-back)
            steps += 1
            engine.step()
        one_prompt()
        prof = profile_steps(engine, steps)
        prof["ms_per_step"] *= steps  # per prompt: every step it took
        prof["top"] = [(key, ms * steps) for key, ms in prof["top"]]
    return n / best, prof


def kv_capacity(engine, fraction: float, budget_bytes: int) -> dict:
    """Latent-KV tokens at `fraction` of `budget_bytes` per rank: what is left after the rank's weights (rank 0's,
    which every rank matches: the splits are even), in tokens of every KV layer, times the ranks with pools of their
    own."""
    model = engine.model
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    cfg, pool = engine.model_config, engine.pool
    per_token = cfg.num_kv_layers * cfg.kv_cache_dim * pool.kv.element_size()
    per_rank = max(0, int(fraction * budget_bytes - weights) // per_token)
    dp = engine.config.parallel.dp_size
    return dict(weights_gib_per_rank=weights / 2**30, kv_bytes_per_token=per_token, tokens_per_rank=per_rank,
                pools=dp, tokens=per_rank * dp)


def run_one(args, name: str) -> dict:
    import torch

    from pdserve.cli import build_parser
    from pdserve.cli.engine_args import engine_config_from_args
    from pdserve.engine import LLMEngine
    from pdserve.weights import single_process_shapes

    s = sizes(args)
    if args.dry_run:
        torch.set_num_threads(1)  # two ranks on a small machine: one thread each
    parsed = build_parser().parse_args(["generate", *engine_flags(args, args.model_dir), *CONFIGS[name]])
    t0 = time.monotonic()
    engine = LLMEngine(engine_config_from_args(parsed), progress=lambda _m: None)
    out = dict(config=name, flags=CONFIGS[name], build_s=time.monotonic() - t0,
               cuda_graphs=engine.runner.graphs is not None)
    try:
        if engine.config.device.startswith("cuda"):
            budget = torch.cuda.get_device_properties(torch.device(engine.config.device)).total_memory
        else:  # the dry run: a pretend device four times the model's single-process size
            budget = 4 * sum(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
                             for _, shape, dtype in single_process_shapes(engine.model))
        out["kv"] = kv_capacity(engine, args.mem_fraction, budget)
        gen = torch.Generator().manual_seed(0)
        out["decode_ms"] = {}
        for b in s["batches"]:
            out["decode_ms"][str(b)], ran = decode_step_ms(engine, gen, b, s["ctx"], s["steps"], args.profile)
            out.setdefault("decode_ran", {})[str(b)] = ran
            print(f"[{name}] decode batch {b:4d} (ctx {s['ctx']}): {out['decode_ms'][str(b)]:8.3f} ms/step, "
                  f"{b / out['decode_ms'][str(b)] * 1e3:9.1f} tok/s (running {ran['mean_running']:.1f} on average, "
                  f"{ran['steps_with_waiting']} of {s['steps']} steps with a request waiting)", flush=True)
            if "profile" in ran:
                print_profile(name, f"batch {b}", ran["profile"], "per step")
        out["prefill_tok_s"] = {}
        for n in s["prefill"]:
            out["prefill_tok_s"][str(n)], prof = prefill_tok_s(engine, gen, n, s["repeats"],
                                                               args.profile and n == min(s["prefill"]))
            print(f"[{name}] prefill {n:6d} tokens: {out['prefill_tok_s'][str(n)]:10.0f} tok/s", flush=True)
            if prof is not None:
                out.setdefault("prefill_profile", {})[str(n)] = prof
                print_profile(name, f"prefill of {n} tokens", prof, "per prompt")
        print(f"[{name}] KV capacity at {args.mem_fraction:.2f} of memory: {out['kv']['tokens']} tokens "
              f"({out['kv']['pools']} pool(s) of {out['kv']['tokens_per_rank']}; weights "
              f"{out['kv']['weights_gib_per_rank']:.2f} GiB per rank)", flush=True)
    finally:
        engine.close()
    return out


# ---- the big configuration: more than one GPU holds --------------------------------------------------------------

def write_big_config(out: str, layers: int) -> str:
    """A V3 configuration of `layers` layers with V3's own dense prefix (3 layers) and its NextN layer, FP8."""
    from benchmarks.bench_one_batch import FP8, V3

    d = os.path.join(out, f"v3-{layers}L")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(dict(V3, num_hidden_layers=layers, first_k_dense_replace=3, quantization_config=FP8,
                       architectures=["DeepseekV3ForCausalLM"]), f, indent=2)
    return d


def checkpoint_gb(model_dir: str) -> float:
    """The model's weights in GB as a single process would hold them (FP8 experts and projections)."""
    import torch

    from pdserve.config import ModelConfig
    from pdserve.kernels import KernelBackends
    from pdserve.weights import build_model, single_process_shapes

    cfg = ModelConfig.from_model_dir(model_dir)
    model = build_model(cfg, torch.bfloat16, KernelBackends.create("torch", "torch", "torch"), "meta")
    return sum(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
               for _, shape, dtype in single_process_shapes(model)) / 1e9


def run_big(args) -> dict:
    """`pdserve generate --tp 2` on the configuration one GPU cannot hold (the demo model in a dry run)."""
    if args.dry_run:
        model_dir, gb, extra = os.path.join(ROOT, "models", "tiny-trained"), None, ["--device", "cpu"]
    else:
        model_dir = write_big_config(args.out, args.big_layers)
        gb = checkpoint_gb(model_dir)
        extra = ["--device", "cuda", "--load-format", "dummy", "--cuda-graph-max-bs", "1", "--num-pages", "256"]
    cmd = [sys.executable, "-m", "pdserve", "generate", "--model", model_dir, "--tp", "2", "--input-ids",
           ",".join(str(10 + i) for i in range(64)), "--max-new-tokens", "16", "--ignore-eos", "--json", *extra]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    printed = os.path.join(args.out, "big_generate.json")
    with open(printed, "w") as f:  # (a file, not a pipe: see main)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, timeout=args.big_timeout)
    took = time.monotonic() - t0
    result = dict(model=os.path.basename(model_dir), weights_gb=gb, exit=proc.returncode, wall_s=took)
    if proc.returncode == 0:
        with open(printed) as f:
            result["output_ids"] = json.loads(f.read().strip().splitlines()[-1])["output_ids"]
    print(f"[big] {result['model']} ({gb and f'{gb:.0f} GB'}): exit {proc.returncode} in {took:.0f} s, "
          f"{len(result.get('output_ids', []))} tokens", flush=True)
    return result


# ---- the parent: every configuration, then the table ------------------------------------------------------------

def targets(results: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) of each issue-45 target; met None where a number is missing."""
    def ratio(a, b):
        return None if a is None or b is None else a / b

    def get(name, *keys):
        value = results.get(name)
        for k in keys:
            value = None if value is None else value.get(k)
        return value

    rows = []
    batches = sorted({int(b) for r in results.values() if isinstance(r, dict) for b in r.get("decode_ms", {})})
    for b in batches[:2]:  # batch 1 and 32 on GPUs
        r = ratio(get("tp2", "decode_ms", str(b)), get("tp1", "decode_ms", str(b)))
        rows.append((f"decode step TP2 / TP1 at batch {b} <= 0.60", _fmt(r), None if r is None else r <= 0.60))
    lengths = sorted({int(n) for r in results.values() if isinstance(r, dict) for n in r.get("prefill_tok_s", {})})
    if lengths:
        n = lengths[0]
        r = ratio(get("tp2", "prefill_tok_s", str(n)), get("tp1", "prefill_tok_s", str(n)))
        rows.append((f"prefill {n} tokens TP2 / TP1 >= 1.7", _fmt(r), None if r is None else r >= 1.7))
    r = ratio(get("tp2-dp", "kv", "tokens"), get("tp2", "kv", "tokens"))
    rows.append(("KV capacity DP attention / TP2 >= 1.9", _fmt(r), None if r is None else r >= 1.9))
    if batches:
        b = batches[-1]
        r = ratio(get("tp2", "decode_ms", str(b)), get("tp2-dp", "decode_ms", str(b)))  # tok/s ratio
        rows.append((f"decode tok/s DP attention / TP2 at batch {b} >= 1", _fmt(r), None if r is None else r >= 1.0))
    big = results.get("big")
    rows.append(("16-layer + NextN V3 generates with --tp 2" if big and big.get("weights_gb") else
                 "pdserve generate --tp 2 (dry run: the demo model)",
                 "not run" if big is None else f"exit {big['exit']}, {len(big.get('output_ids', []))} tokens",
                 None if big is None else big["exit"] == 0 and bool(big.get("output_ids"))))
    return rows


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def table(results: dict) -> str:
    names = [n for n in CONFIGS if isinstance(results.get(n), dict) and "decode_ms" in results[n]]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    if names:
        for b in results[names[0]]["decode_ms"]:
            lines.append(f"| decode step ms, batch {b} | " + " | ".join(
                f"{results[n]['decode_ms'][b]:.3f}" for n in names) + " |")
        for n_tok in results[names[0]]["prefill_tok_s"]:
            lines.append(f"| prefill tok/s, {n_tok} tokens | " + " | ".join(
                f"{results[n]['prefill_tok_s'][n_tok]:.0f}" for n in names) + " |")
        lines.append("| KV capacity, tokens | " + " | ".join(str(results[n]["kv"]["tokens"]) for n in names) + " |")
        lines.append("| CUDA graphs | " + " | ".join(str(results[n]["cuda_graphs"]) for n in names) + " |")
    lines += ["", "| issue-45 target | measured | |", "|---|---|---|"]
    for what, measured, met in targets(results):
        lines.append(f"| {what} | {measured} | {'met' if met else 'MISSED' if met is False else 'not measured'} |")
    return "\n".join(lines)


def write_results(out: str, stem: str, results: dict, text: str) -> None:
    """Print the table `text`; write it to OUT/STEM.md and the results behind it to OUT/STEM.json."""
    print(text)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(text + "\n")
    print(f"wrote {os.path.join(out, stem + '.json')} and {stem}.md")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for tp.json, tp.md and the generated configs")
    p.add_argument("--dry-run", action="store_true", help="the CPU: the demo model, Gloo ranks, tiny sizes")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--decode-ctx", type=int, default=1024, help="prompt tokens of each decoding request")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="of each GPU's memory for weights + KV")
    p.add_argument("--big-layers", type=int, default=16, help="layers of the configuration one GPU cannot hold")
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="after each batch's timed steps, profile a few more, and one more prompt of the shortest "
                        "prefill length (rank 0's view): device time per step or prompt, the share in NCCL "
                        "kernels, the busiest operations")
    p.add_argument("--config-timeout", type=float, default=150, help="seconds per configuration's process")
    p.add_argument("--big-timeout", type=float, default=240)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="the whole run's wall time: a configuration that would not fit (the big one's time kept "
                        "aside) is reported not run, so the table always comes")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: this configuration only, its JSON into --result
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model_dir = (os.path.join(ROOT, "models", "tiny-trained") if args.dry_run
                      else os.path.join(args.out, "v3-slice-4L"))
    if args.one:
        out = run_one(args, args.one)
        with open(args.result, "w") as f:
            json.dump(out, f)
        return
    os.makedirs(args.out, exist_ok=True)
    if not args.dry_run:
        from benchmarks.bench_serving import write_v3_config

        write_v3_config(args.out, 4)
    results: dict = {}
    child = sys.argv[1:]
    deadline = time.monotonic() + (args.time_budget_s or float("inf"))
    aside = 0 if args.skip_big else args.big_timeout
    pool = ThreadPoolExecutor(1)
    # A dry run's big configuration (`pdserve generate --tp 2`, processes of their own, most of their start-up
    # torch's import on one core each) runs beside the others. On GPUs it runs alone: it needs their memory.
    big_beside = pool.submit(run_big, args) if args.dry_run and not args.skip_big else None
    for name in args.configs:
        if args.dry_run:  # (the CPU: no device memory to give back between configurations, one process will do)
            results[name] = run_one(args, name)
            continue
        limit = min(args.config_timeout, deadline - time.monotonic() - aside)
        if limit < 30:
            print(f"[{name}] not run: {limit:.0f} s left of the time budget", flush=True)
            results[name] = {"error": "not run (time budget)"}
            continue
        # NOTE: the child's result comes back in a file, not through a pipe: its ranks inherit its stdout, and a
        # pipe held open by a rank that outlives a killed child would keep this process waiting past the limit.
        result = os.path.join(args.out, f"{name}.json")
        if os.path.exists(result):
            os.remove(result)
        try:
            code = subprocess.run([sys.executable, __file__, *child, "--one", name, "--result", result], cwd=ROOT,
                                  timeout=limit).returncode
        except subprocess.TimeoutExpired:
            print(f"[{name}] TIMED OUT after {limit:.0f} s", flush=True)
            code = "timed out"
        if code != 0 or not os.path.exists(result):
            print(f"[{name}] FAILED ({code})", flush=True)
            results[name] = {"error": str(code)}
            continue
        with open(result) as f:
            results[name] = json.load(f)
    if not args.skip_big:
        args.big_timeout = max(1.0, min(args.big_timeout, deadline - time.monotonic()))
        try:
            results["big"] = big_beside.result() if big_beside else run_big(args)
        except subprocess.TimeoutExpired:
            print(f"[big] TIMED OUT after {args.big_timeout:.0f} s", flush=True)
            results["big"] = {"exit": "timed out", "weights_gb": None}
    write_results(args.out, "tp", results, table(results))
    if any("error" in r for r in results.values() if isinstance(r, dict)):
        sys.exit(1)


if __name__ == "__main__":
    main()
