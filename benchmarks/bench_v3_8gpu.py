"""DeepSeek-V3's full geometry on eight GPUs (issue 47), one table with each target met or missed.

(a) One colocated worker with V3's whole shape (61 layers, V3's 3 dense first, + the NextN layer; 256 experts, 128
    heads, block-FP8 weights, `--load-format dummy`), built as `pdserve generate` builds it, in a process of its own
    per configuration: TP8, and TP8 + DP attention + EP8, each without and with NextN speculation:
    - decode tok/s at batch 1 (with NextN: the tokens the engine emits per second, its rounds as it takes them, and
      the tokens per round), at batch 32 and 128 (prompts of --decode-ctx tokens);
    - prefill tok/s of one prompt of 4k and of 16k tokens;
    - the decode step at batch 1 against the per-GPU HBM read floor: the bytes the busiest GPU must read in one step
      (its shards of the attention, dense, shared-expert, router and lm_head weights; of the routed experts, the
      expected share a batch of B tokens touches with 8 of 256 routed per token: under TP each expert's slice,
      under EP only the rank's own experts; the latent KV its requests attend over) over the bandwidth of a
      device-to-device copy (bytes read + written per second) measured in the same process.
(b) Prefill and decode on one host: a prefill worker TP4 on GPUs 0-3 and a decode worker TP4 on GPUs 4-7 through
    `pdserve up` + `pdserve bench` (benchmarks/bench_serving.py), 2048 in / 64 out at concurrency 1, 32 and 128, with
    as many layers as fit (the full model does not: the choice and the arithmetic behind it are printed).

    python benchmarks/bench_v3_8gpu.py --out DIR                        # eight GPUs (bash benchmarks/gpu.sh v3-8gpu)
    python benchmarks/bench_v3_8gpu.py --out DIR --gpus 2 --layers 8    # the same launch on two GPUs: TP2, 8 layers
    python benchmarks/bench_v3_8gpu.py --out DIR --dry-run              # the CPU: demo model, TP2 over Gloo, seconds
    python benchmarks/bench_v3_8gpu.py --out DIR --report DIR1 DIR2     # one table from the parts of several calls

A whole run takes longer than one device call: --parts picks some (what does not fit --time-budget-s is reported
not run); each part leaves part_<name>.json in --out, and --report merges the folders of several calls.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import bench_tp  # noqa: E402

PARTS = ("tp", "tp-nextn", "dp-ep", "dp-ep-nextn", "pd")
TARGET_TOK_S = 45.0  # batch 1, CUDA graphs, no speculation
TARGET_NEXTN_TOK_S = 110.0
TARGET_FLOOR_RATIO = 1.3
PD_CONCURRENCY = (1, 32, 128)
PD_IN, PD_OUT = 2048, 64


def config_flags(part: str, n: int, spec_steps: int) -> list[str]:
    """`pdserve generate` flags of a colocated part on n GPUs (after the common engine flags: these win)."""
    flags = ["--tp", str(n)]
    if part.startswith("dp-ep"):
        flags += ["--dp-attention", "--ep", str(n)]
    if part.endswith("nextn"):  # batch 1 only: no graphs or requests beyond it
        flags += ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(spec_steps),
                  "--max-running-requests", "1", "--cuda-graph-max-bs", "1"]
    return flags


def label(part: str, n: int) -> str:
    return f"TP{n}" + (f" + DP attention + EP{n}" if part.startswith("dp-ep") else "") + (
        " + NextN" if part.endswith("nextn") else "")


def model_dir(args) -> str:
    """The colocated parts' model: V3's geometry with --layers layers (V3's 3 dense first) + NextN; the demo model
    in a dry run."""
    if args.dry_run:
        return os.path.join(ROOT, "models", "tiny-trained")
    return bench_tp.write_big_config(args.out, args.layers)


# ---- the read floor (pure arithmetic on a rank's shapes) ----------------------------------------------------------

def rank_model(cfg, dtype, tp: int, ep: bool, dp_attention: bool):
    """Rank 0's shards of the model on the meta device: the shapes and dtypes the worker's rank 0 holds (every
    rank's splits are even, so rank 0 stands for each)."""
    from pdserve.kernels import KernelBackends
    from pdserve.parallel.group import TPGroup
    from pdserve.weights import build_model

    return build_model(cfg, dtype, KernelBackends.create("torch", "torch", "torch"), "meta", tp=TPGroup(0, tp), ep=ep,
                       dp_attention=dp_attention)


def floors(args, part: str, result: dict) -> dict:
    """The read floor of each measured decode batch of a colocated part at its measured copy bandwidth.

    NOTE: the rate is the copy's bytes read + written per second, not half of it: HBM moves reads and writes through
    the same channels, and a step that only reads reaches that rate: a floor at half of it is not one (decode steps
    have run below such a floor)."""
    from benchmarks.bench_one_batch import read_floor
    from pdserve.config import ModelConfig
    from pdserve.weights import resolve_dtype

    cfg = ModelConfig.from_model_dir(args.model_dir)
    dp = part.startswith("dp-ep")
    model = rank_model(cfg, resolve_dtype("float32" if args.dry_run else "auto", cfg), args.tp, dp, dp)
    s = bench_tp.sizes(args)
    read_rate = result["copy_bw"]
    out = {}
    for b, ms in result.get("decode_ms", {}).items():
        f = read_floor(model, cfg, int(b), s["ctx"] + s["steps"], result["kv_bytes_per_value"], args.tp if dp else 1)
        f.update(floor_ms=f["total"] / read_rate * 1e3, ratio=ms / (f["total"] / read_rate * 1e3))
        out[b] = f
    return out


# ---- (a) one colocated configuration (a child process on GPUs) ----------------------------------------------------

def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a copy on `device` (the GPU rank 0 runs on)."""
    import torch

    if device.startswith("cuda"):
        from benchmarks.timing import copy_bandwidth as device_copy

        return device_copy()
    x = torch.empty(1 << 26, dtype=torch.uint8)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(4):
        t = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() / best


def nextn_decode(engine, gen, ctx: int, steps: int, k: int) -> dict:
    """One request drafting and verifying (NextN, k steps) in the steady state: engine steps (one round each) and
    the tokens they emit, timed over `steps` rounds; budget enough that it never finishes inside them."""
    from pdserve.sampling import SamplingParams

    spec = engine.speculator
    rid = engine.add_request(bench_tp._prompt(gen, ctx, engine.model_config.vocab_size),
                             SamplingParams(max_new_tokens=(steps + 8) * (k + 1), ignore_eos=True))
    rounds = 0
    while rounds < 3:  # the prompt, then warm-up rounds
        rounds += sum(bool(o.new_token_ids) for o in engine.step())
    bench_tp._sync(engine.config.device)
    rows, emitted, tokens = spec.num_rows, spec.num_emitted, 0
    start = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    bench_tp._sync(engine.config.device)
    took = time.perf_counter() - start
    engine.abort(rid)
    while engine.has_unfinished:
        engine.step()
    return dict(round_ms=took / steps * 1e3, tok_s=tokens / took,
                accept_length=(spec.num_emitted - emitted) / max(1, spec.num_rows - rows))


def run_one(args, part: str) -> dict:
    import torch

    from pdserve.cli import build_parser
    from pdserve.cli.engine_args import engine_config_from_args
    from pdserve.engine import LLMEngine

    s = bench_tp.sizes(args)
    if args.dry_run:
        torch.set_num_threads(1)  # two ranks on a small machine: one thread each
    flags = [*bench_tp.engine_flags(args, args.model_dir), *config_flags(part, args.tp, args.spec_steps)]
    parsed = build_parser().parse_args(["generate", *flags])
    t0 = time.monotonic()
    engine = LLMEngine(engine_config_from_args(parsed), progress=lambda _m: None)
    tag = f"[{part}]"
    out = dict(part=part, label=label(part, args.tp), command=shlex.join(["pdserve", "generate", *flags]),
               build_s=time.monotonic() - t0, cuda_graphs=engine.runner.graphs is not None,
               kv_bytes_per_value=engine.pool.kv.element_size(), random_weights=engine.config.load_format == "dummy")
    print(f"{tag} {out['label']}: built in {out['build_s']:.0f} s (CUDA graphs: {out['cuda_graphs']})", flush=True)
    try:
        out["copy_bw"] = copy_bandwidth(engine.config.device)
        print(f"{tag} copy bandwidth {out['copy_bw'] / 1e12:.3f} TB/s (read + write)", flush=True)
        gen = torch.Generator().manual_seed(0)
        if engine.speculator is not None:
            out["nextn"] = nextn_decode(engine, gen, s["ctx"], s["steps"], args.spec_steps)
            n = out["nextn"]
            print(f"{tag} decode batch 1 with NextN (k={args.spec_steps}): {n['tok_s']:.1f} tok/s, round "
                  f"{n['round_ms']:.3f} ms, {n['accept_length']:.2f} tokens per round", flush=True)
            return out
        out["decode_ms"] = {}
        for b in s["batches"]:
            ms, ran = bench_tp.decode_step_ms(engine, gen, b, s["ctx"], s["steps"])
            out["decode_ms"][str(b)] = ms
            out.setdefault("decode_ran", {})[str(b)] = ran
            print(f"{tag} decode batch {b:4d} (ctx {s['ctx']}): {ms:8.3f} ms/step, {b / ms * 1e3:9.1f} tok/s "
                  f"(running {ran['mean_running']:.1f} on average, {ran['steps_with_waiting']} of {s['steps']} steps "
                  "with a request waiting)", flush=True)
        out["prefill_tok_s"] = {}
        for n_tok in s["prefill"]:
            rate = out["prefill_tok_s"][str(n_tok)] = bench_tp.prefill_tok_s(engine, gen, n_tok, s["repeats"])[0]
            print(f"{tag} prefill {n_tok:6d} tokens: {rate:10.0f} tok/s", flush=True)
    finally:
        engine.close()
    return out


# ---- (b) prefill and decode workers on GPUs of their own ----------------------------------------------------------

def pd_layout(gpus: int) -> dict:
    """Each tier's TP size and GPUs as `pdserve up` places them (pdserve/cli/gpu_layout.py: a worker on its tier's
    first GPU, its ranks counted up from there: pdserve/parallel/group.py), checked disjoint and present."""
    from pdserve.cli.gpu_layout import place_workers
    from pdserve.parallel.group import rank_device

    tp = gpus // 2
    prefill, decode = tuple(range(tp)), tuple(range(tp, 2 * tp))
    placed = place_workers("cuda", 1, 1, "auto", gpus, prefill_gpus=prefill, decode_gpus=decode)
    ranks = {role: [rank_device(dev, r) for r in range(tp)] for role, dev in (("prefill", placed.prefill[0]),
                                                                              ("decode", placed.decode[0]))}
    every = ranks["prefill"] + ranks["decode"]
    assert len(set(every)) == len(every) == 2 * tp and all(int(d.split(":")[1]) < gpus for d in every), ranks
    return dict(tp=tp, prefill_gpus=list(prefill), decode_gpus=list(decode), ranks=ranks,
                up_args=[f"--up-arg=--tp={tp}", "--up-arg=--prefill-gpus=" + ",".join(map(str, prefill)),
                         "--up-arg=--decode-gpus=" + ",".join(map(str, decode))])


def model_bytes_per_gpu(raw: dict, tp: int) -> float:
    """Rank 0's weights (every tensor it holds, FP8 and block scales included) of the V3 config `raw` at TP tp."""
    import torch

    from pdserve.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(raw)
    model = rank_model(cfg, torch.bfloat16, tp, False, False)
    return float(sum(p.numel() * p.element_size() for p in model.parameters()))


def pd_layers(tp: int, memory: float, cap: int, fraction: float, reserve: float) -> dict:
    """The most layers (+ NextN) of bench_serving.py's V3 slice (its first layer dense) whose weights and KV pool fit
    `fraction` of a GPU's `memory` less `reserve` (CUDA graphs, activations, NCCL, workspaces) at TP tp, the pool
    sized as bench_serving.py sizes it for the top concurrency; the full model's size per GPU beside it."""
    from benchmarks.bench_one_batch import FP8, V3

    def slice_raw(layers):
        return dict(V3, num_hidden_layers=layers, quantization_config=FP8)

    w2, w3 = model_bytes_per_gpu(slice_raw(2), tp), model_bytes_per_gpu(slice_raw(3), tp)
    per_layer, base = w3 - w2, w2 - 2 * (w3 - w2)  # each further layer is a MoE layer of the same size
    pages = int((-(-(PD_IN + PD_OUT) // 16) + 1) * max(PD_CONCURRENCY) * 1.1) + 64
    kv_per_layer = pages * 16 * (V3["kv_lora_rank"] + V3["qk_rope_head_dim"]) * 2  # bf16 latent KV, every rank
    budget = fraction * memory - reserve

    def need(layers):
        return base + layers * per_layer + (layers + 1) * kv_per_layer  # + 1: the NextN layer's KV

    fits = [n for n in range(1, cap + 1) if need(n) <= budget]
    full = model_bytes_per_gpu(dict(V3, num_hidden_layers=61, first_k_dense_replace=3, quantization_config=FP8), tp)
    return dict(layers=max(fits) if fits else 0, budget=budget, memory=memory, fraction=fraction, reserve=reserve,
                per_layer=per_layer, base=base, kv_pages=pages, kv_per_layer=kv_per_layer, full_model=full,
                need=need(max(fits)) if fits else None, need_next=need((max(fits) if fits else 0) + 1))


def gpu_memory(args) -> float:
    """GPU 0's memory in bytes, from nvidia-smi: torch would hold a CUDA context on GPU 0 in this process for the
    whole run, beside the workers."""
    if args.gpu_memory_gib:
        return args.gpu_memory_gib * 2**30
    mib = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return float(mib.strip()) * 2**20


def run_pd(args, deadline: float) -> dict:
    """bench_serving.py's stack (`pdserve up` + `pdserve bench`) with a TP prefill worker on the first half of the
    GPUs and a TP decode worker on the other half; on the CPU (dry run) both workers TP2 on the demo model."""
    layout = pd_layout(8 if args.dry_run else args.gpus)  # a dry run: the placement and layers of eight GPUs
    plan = pd_layers(layout["tp"], gpu_memory(args), args.layers, args.pd_mem_fraction, args.pd_reserve_gib * 2**30)
    gb = 1e9
    print(f"[pd] prefill worker TP{layout['tp']} on {', '.join(layout['ranks']['prefill'])}; decode worker "
          f"TP{layout['tp']} on {', '.join(layout['ranks']['decode'])}", flush=True)
    print(f"[pd] the full FP8 model (61 layers + NextN) is {plan['full_model'] / gb:.0f} GB per GPU at "
          f"TP{layout['tp']}; a GPU holds {plan['memory'] / gb:.0f} GB, of which weights and KV may take "
          f"{plan['budget'] / gb:.0f} GB ({plan['fraction']:.2f} of it less {plan['reserve'] / 2**30:.0f} GiB for "
          f"CUDA graphs, activations, NCCL and workspaces). Per GPU: {plan['base'] / gb:.1f} GB (embedding, lm_head, "
          f"NextN) + {plan['per_layer'] / gb:.2f} GB per MoE layer + {plan['kv_per_layer'] / gb:.2f} GB of KV per "
          f"layer ({plan['kv_pages']} pages: {max(PD_CONCURRENCY)} requests of {PD_IN}+{PD_OUT} tokens). "
          f"{plan['layers']} layers + NextN need {(plan['need'] or 0) / gb:.0f} GB, "
          f"{plan['layers'] + 1} would need {plan['need_next'] / gb:.0f} GB: {plan['layers']} layers"
          + (f" (--layers {args.layers} caps it)" if plan["layers"] == args.layers else ""), flush=True)
    out = os.path.join(args.out, "pd")
    if args.dry_run:  # the demo model on the CPU, both workers TP2: the same stack and bench, no GPU lists
        model, layers = ["--models", "demo", "--device", "cpu", "--concurrency", "2", "--num-prompts", "2",
                         "--demo-input-len", "16", "--demo-output-len", "4"], None
        up_args = ["--up-arg=--tp=2"]
    else:
        layers = plan["layers"]
        model = ["--models", "v3", "--v3-layers", str(layers), "--concurrency", *map(str, PD_CONCURRENCY),
                 "--v3-input-len", str(PD_IN), "--v3-output-len", str(PD_OUT), "--cuda-graph-max-bs",
                 str(max(PD_CONCURRENCY))]
        up_args = layout["up_args"]
    cmd = [sys.executable, "benchmarks/bench_serving.py", "--out", out, *model, "--skip-engine",
           "--prompts-only-concurrency", "0", *up_args]
    ran = (f"prefill worker TP{layout['tp']} on {','.join(layout['ranks']['prefill'])}, decode worker "
           f"TP{layout['tp']} on {','.join(layout['ranks']['decode'])}, {layers} layers + NextN" if layers else
           "dry run: the demo model on the CPU, prefill and decode workers TP2 (the eight-GPU placement and layer "
           "count above computed, not run)")
    result = dict(layout=layout, plan=plan, layers=layers, ran=ran, command=shlex.join(["python", *cmd[1:]]),
                  runs=[])
    print("[pd] + " + result["command"], flush=True)
    limit = deadline - time.monotonic()
    if limit < 60:
        print(f"[pd] not run: {limit:.0f} s left of the time budget", flush=True)
        result["error"] = "not run (time budget)"
        return result
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)  # its own group: `up` goes with it on a timeout
    try:
        proc.wait(limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        result["error"] = f"timed out after {limit:.0f} s"
    try:
        with open(os.path.join(out, "serving.json")) as f:
            entry = next(iter(json.load(f)["models"].values()))
    except (OSError, ValueError, StopIteration) as e:
        result.setdefault("error", f"no serving.json ({type(e).__name__})")
        return result
    if "error" in entry:
        result["error"] = entry["error"][-500:]
    for r in entry["stack"]["runs"]:
        result["runs"].append(dict(concurrency=r["concurrency"], completed=r["completed"], failed=r["failed"],
                                   output_tok_s=r["output_token_throughput"], ttft_p50_ms=r["ttft"]["median_ms"],
                                   itl_mean_ms=r["itl"]["mean_ms"]))
    return result


# ---- the table --------------------------------------------------------------------------------------------------

def _fmt(x, spec="{:.2f}") -> str:
    return "n/a" if x is None else spec.format(x)


def targets(results: dict, n: int) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) of each issue-47 target; met None where the number is missing."""
    rows = []
    for part in ("tp", "dp-ep"):
        ms = results.get(part, {}).get("decode_ms", {}).get("1")
        tok_s = None if ms is None else 1e3 / ms
        rows.append((f"batch-1 decode, {label(part, n)}, no speculation >= {TARGET_TOK_S:g} tok/s",
                     _fmt(tok_s, "{:.1f} tok/s"), None if tok_s is None else tok_s >= TARGET_TOK_S))
    for part in ("tp-nextn", "dp-ep-nextn"):
        nx = results.get(part, {}).get("nextn")
        measured = "n/a" if nx is None else (
            f"{nx['tok_s']:.1f} tok/s at {nx['accept_length']:.2f} tokens per round"
            + (" (random weights: a trained NextN layer's drafts are accepted far more often)" if results[part].get(
                "random_weights") else "") + "; "
            f"{TARGET_NEXTN_TOK_S:g} needs {TARGET_NEXTN_TOK_S * nx['round_ms'] / 1e3:.2f} per round")
        rows.append((f"batch-1 decode, {label(part, n)} >= {TARGET_NEXTN_TOK_S:g} tok/s", measured,
                     None if nx is None else nx["tok_s"] >= TARGET_NEXTN_TOK_S))
    for part in ("tp", "dp-ep"):
        f = results.get(part, {}).get("floor", {}).get("1")
        rows.append((f"decode step at batch 1, {label(part, n)} <= {TARGET_FLOOR_RATIO:g}x the per-GPU read floor",
                     "n/a" if f is None else f"{f['ratio']:.2f}x ({f['total'] / 1e9:.2f} GB, {f['floor_ms']:.3f} ms)",
                     None if f is None else f["ratio"] <= TARGET_FLOOR_RATIO))
    pd = results.get("pd")
    runs = (pd or {}).get("runs", [])
    failed, total = sum(r["failed"] for r in runs), sum(r["failed"] + r["completed"] for r in runs)
    unmeasured = pd is None or pd.get("error", "").startswith("not run")
    rows.append(("zero failed requests through the stack (PD)",
                 "not run" if pd is None else f"{failed} of {total} failed" + (
                     f"; {pd['error'][:120]}" if "error" in pd else ""),
                 None if unmeasured else bool(runs) and "error" not in pd and failed == 0))
    return rows


def table(results: dict, n: int) -> str:
    colo = [p for p in ("tp", "dp-ep") if "decode_ms" in results.get(p, {})]
    lines = ["| | " + " | ".join(label(p, n) for p in colo) + " |", "|---" * (len(colo) + 1) + "|"]
    if colo:
        first = results[colo[0]]
        lines.append("| decode tok/s, batch 1 | " + " | ".join(
            f"{1e3 / results[p]['decode_ms']['1']:.1f}" for p in colo) + " |")
        lines.append("| decode tok/s, batch 1, NextN (tokens per round) | " + " | ".join(
            f"{results[p + '-nextn']['nextn']['tok_s']:.1f} ({results[p + '-nextn']['nextn']['accept_length']:.2f})"
            if "nextn" in results.get(p + "-nextn", {}) else "n/a" for p in colo) + " |")
        for b in first["decode_ms"]:
            if b != "1":
                lines.append(f"| decode tok/s, batch {b} | " + " | ".join(
                    f"{int(b) * 1e3 / results[p]['decode_ms'][b]:.1f}" for p in colo) + " |")
        for t in first["prefill_tok_s"]:
            lines.append(f"| prefill tok/s, {t} tokens | " + " | ".join(
                f"{results[p]['prefill_tok_s'][t]:.0f}" for p in colo) + " |")
        lines.append("| decode step ms, batch 1 | " + " | ".join(
            f"{results[p]['decode_ms']['1']:.3f}" for p in colo) + " |")
        lines.append("| read floor per GPU, batch 1: GB (weights + experts + KV) | " + " | ".join(
            "{:.2f} ({:.2f} + {:.2f} + {:.3f})".format(*(results[p]["floor"]["1"][k] / 1e9 for k in (
                "total", "weights", "experts", "kv"))) for p in colo) + " |")
        lines.append("| copy bandwidth TB/s (read + write: the floor's rate) | " + " | ".join(
            f"{results[p]['copy_bw'] / 1e12:.3f}" for p in colo) + " |")
        lines.append("| step / floor at batch 1 | " + " | ".join(
            f"{results[p]['floor']['1']['ratio']:.2f}" for p in colo) + " |")
        lines.append("| CUDA graphs | " + " | ".join(str(results[p]["cuda_graphs"]) for p in colo) + " |")
    pd = results.get("pd")
    if pd:
        lines += ["", f"PD: {pd['ran']} (`{pd['command']}`)", "",
                  "| concurrency | completed | failed | out tok/s | TTFT p50 ms | ITL mean ms |",
                  "|---|---|---|---|---|---|"]
        for r in pd["runs"]:
            lines.append(f"| {r['concurrency']} | {r['completed']} | {r['failed']} | {r['output_tok_s']:.0f} | "
                         f"{_fmt(r['ttft_p50_ms'], '{:.1f}')} | {_fmt(r['itl_mean_ms'], '{:.2f}')} |")
    lines += ["", "| issue-47 target | measured | |", "|---|---|---|"]
    for what, measured, met in targets(results, n):
        lines.append(f"| {what} | {measured} | {'met' if met else 'MISSED' if met is False else 'not measured'} |")
    return "\n".join(lines)


def report(folders: list[str]) -> dict:
    """Every part_<name>.json of `folders` (a later folder's part over an earlier one's)."""
    results: dict = {}
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "part_*.json"))):
            with open(path) as f:
                r = json.load(f)
            results[r["part"]] = r
    return results


def save_part(args, part: str, result: dict) -> None:
    result["part"] = part
    with open(os.path.join(args.out, f"part_{part}.json"), "w") as f:
        json.dump(result, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for part_<name>.json, v3_8gpu.json, v3_8gpu.md, pd/")
    p.add_argument("--dry-run", action="store_true", help="the CPU: the demo model, TP2 over Gloo, tiny sizes")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the colocated worker (TP/EP size); PD: half each")
    p.add_argument("--layers", type=int, default=61, help="V3's main layers (+ NextN); PD: at most this many")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--spec-steps", type=int, default=3, help="NextN draft steps per round")
    p.add_argument("--decode-ctx", type=int, default=1024, help="prompt tokens of each decoding request")
    p.add_argument("--steps", type=int, default=20, help="decode steps (rounds) timed per batch")
    p.add_argument("--pd-mem-fraction", type=float, default=0.90, help="of each GPU's memory for weights + KV")
    p.add_argument("--pd-reserve-gib", type=float, default=8.0, help="kept aside for graphs, activations, NCCL")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="a GPU's memory for the PD layer count (default: GPU 0's; 139 in a dry run: an H200)")
    p.add_argument("--config-timeout", type=float, default=420, help="seconds per colocated part's process")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="this call's wall time: a part that would not fit is reported not run, so the table comes")
    p.add_argument("--report", nargs="+", metavar="DIR", help="only the table, from these folders' part files")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: this part only, its JSON to stdout's last line
    args = p.parse_args()
    if args.dry_run:
        args.gpus, args.gpu_memory_gib = 2, args.gpu_memory_gib or 139.0
    if args.gpus < 2 or args.gpus % 2:
        p.error(f"--gpus {args.gpus}: an even number, at least 2 (PD splits them in half)")
    if not 4 <= args.layers <= 61:
        p.error(f"--layers {args.layers}: 4 to 61 (V3's 3 dense layers, then MoE layers)")
    args.tp = args.gpus
    os.makedirs(args.out, exist_ok=True)
    if args.report:
        results = report(args.report)
        n = next((int(r["label"][2:].split()[0]) for r in results.values() if "label" in r), args.gpus)
        finish(args, results, n)
        return
    args.model_dir = model_dir(args)
    if args.one:
        print(json.dumps(run_one(args, args.one)), flush=True)
        return
    deadline = time.monotonic() + (args.time_budget_s or float("inf"))
    results: dict = {}
    with ThreadPoolExecutor(1) as pool:
        # A dry run's PD stack (processes of their own, most of their start-up torch's import on one core each) runs
        # beside the colocated parts. On GPUs every part runs alone: it would share their memory and time.
        pd_beside = pool.submit(run_pd, args, deadline) if args.dry_run and "pd" in args.parts else None
        for part in args.parts:
            if part == "pd":
                results[part] = pd_beside.result() if pd_beside else run_pd(args, deadline)
            elif args.dry_run:  # (the CPU: no device memory to give back between parts, one process will do)
                results[part] = run_one(args, part)
            else:
                results[part] = child(args, part, deadline)
            if "copy_bw" in results[part] and "decode_ms" in results[part]:
                results[part]["floor"] = floors(args, part, results[part])
                f = results[part]["floor"]["1"]
                print(f"[{part}] read floor per GPU at batch 1: {f['total'] / 1e9:.3f} GB = {f['floor_ms']:.3f} ms; "
                      f"the step is {f['ratio']:.2f}x it", flush=True)
            save_part(args, part, results[part])
    finish(args, report([args.out]), args.tp)
    if any("error" in r for r in results.values()):
        sys.exit(1)


def child(args, part: str, deadline: float) -> dict:
    """A colocated part in a process of its own (its GPU memory returns at its end)."""
    limit = min(args.config_timeout, deadline - time.monotonic())
    if limit < 60:
        print(f"[{part}] not run: {limit:.0f} s left of the time budget", flush=True)
        return {"label": label(part, args.tp), "error": "not run (time budget)"}
    try:
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", part], cwd=ROOT, timeout=limit,
                              stdout=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        print(f"[{part}] TIMED OUT after {limit:.0f} s", flush=True)
        return {"label": label(part, args.tp), "error": "timed out"}
    lines = proc.stdout.strip().splitlines()
    sys.stdout.write("".join(line + "\n" for line in lines[:-1]))
    if proc.returncode != 0 or not lines:
        print(f"[{part}] FAILED (exit {proc.returncode})", flush=True)
        return {"label": label(part, args.tp), "error": f"exit {proc.returncode}"}
    return json.loads(lines[-1])


def finish(args, results: dict, n: int) -> None:
    bench_tp.write_results(args.out, "v3_8gpu", results, table(results, n))


if __name__ == "__main__":
    main()
