"""The service against the engine, in one run: `pdserve up` (router + 1 prefill + 1 decode process on one device,
its default KV transport: auto, i.e. cuda_ipc on one GPU, tcp on the CPU) driven by `pdserve bench`, then the engine alone (`LLMEngine` in a process of its own, no gRPC) on
the same prompts and batch sizes; one table of stack / engine ratios.

    python benchmarks/bench_serving.py --out DIR [--models demo v3] [--concurrency 1 8 32 128] [--cold]
    python benchmarks/bench_serving.py --out DIR --device cpu --models demo --concurrency 1 2 --num-prompts 4 \\
        --demo-input-len 16 --demo-output-len 4          # the CPU smoke test (tests/test_bench_serving.py)

Per model: `pdserve up` as a user starts it, until it prints "pdserve is up" (start-up and warm-up times are read
from its log); then `pdserve bench --json` at each concurrency, `--num-prompts` prompts (default max(8, 2 x
concurrency)) of random token ids, a new seed per concurrency (no prefix-cache hits between runs); the stack stops.
Then the engine alone, built from the same engine flags (prefix cache off: the prompts share nothing), warmed up
(pdserve/serving/warmup.py), and per concurrency c: the first c prompts of that run admitted together and generated
to the end (offline), each step timed (a step ends with the sampled tokens on the host), twice: the second pass is
reported (the first one's time and longest step are kept beside it). At c=1 instead every prompt of the stack's run,
one at a time (NextN's time per token depends on the text, through the drafts it accepts). It reports output tok/s
(output tokens / wall time, prefill included, as `pdserve bench` counts), the median decode step, TPOT (decode time /
(output tokens - 1)), the prefill rate of the batch (prompt tokens / time of the steps that computed prompts), the
prefill time of one prompt alone (at c=1: the median over the run's prompts; otherwise of 3), and with NextN the
tokens per verification round.

The stack's workers serve /metrics on free ports; around each run their KV transfer time (the prefill worker's, from
its answer to the decode worker's confirmation) and NextN tokens per round are read (benchmarks/stage_times.py).

Ratios (stack / engine): output tok/s at c vs batch c; TPOT and ITL (means) vs the engine's decode step at batch c;
TTFT (median) vs the prefill time of one prompt, and at c=1 the issue's allowance: (TTFT - KV transfer) / prefill
<= 1.10; input tok/s at c vs the engine's prefill rate at batch c. That last
one is diluted by decoding (the stack's wall time holds the generated tokens, the engine's prefill rate does not), so
a prompts-only run measures prefill through the stack: --prompts-only-concurrency c (default 32) prompts of the same
length with 1 new token each, the stack's input tok/s against the engine's prefill rate on c such prompts at once.

Models: `demo` = models/tiny-trained (512 in / 128 out by default); `v3` = a DeepSeek-V3 slice (real widths,
--v3-layers layers + NextN, block-FP8 dummy weights: `--load-format dummy` on a config.json written under --work-dir;
2048 in / 64 out). --cold first clears the Triton cache (TRITON_CACHE_DIR or ~/.triton/cache) and FlashInfer's JIT
cache ($FLASHINFER_WORKSPACE_BASE/.cache/flashinfer), as on a fresh machine, and records the failures of the first
run. Files in DIR (few, so that a device call brings them all back): serving.json (every number of the run: each
`pdserve bench` report, the engine's, the commands, GPU, date, git revision), serving.md (the table), <model>_up.log
(everything `pdserve up` printed). Each run's own files go under --work-dir (default: a temporary folder).

--repeats N measures each model N times, each a fresh stack and then the engine alone again (`<model>_up_r<k>.log`
for the k-th stack). Where the work is bound by the host (the demo model's prefill and NextN rounds: tens of
launches per millisecond of GPU work), a ratio of two such numbers from two processes moves with the speed of the
CPUs each landed on, by tens of percent between stacks on a virtual machine. The main table stays the first repeat's;
a second one gives each ratio's median and range over the repeats (each repeat's stack against the engine run right
after it), and the targets are then judged on those medians.

--explain-ttft says where the c=1 TTFT goes, so that a missed TTFT target comes with its why: the stack runs traced
(PDSERVE_TRACE: each process timestamps each request's points, a line per point, benchmarks/trace_report.py), and
each c=1 run's first tokens are split into the router and its hop to the prefill engine, the live prefill step (to
hold against the engine's prefill of the same prompts), the way back to the router's send, and the client's two hops
(its TTFT less the router's send); and this host's bare gRPC message between two processes is timed first
(benchmarks/grpc_hop.py), after 2 ms idle (a process busy with the decode, as the client and the router are) and after
110 ms (the prefill worker's idle time between two prompts): four of those in a row are the floor of what the stack
adds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEMO_MODEL = os.path.join(ROOT, "models", "tiny-trained")

from benchmarks import grpc_hop, host_speed, trace_report  # noqa: E402
from benchmarks.serving_report import markdown, summarize  # noqa: E402  (ROOT on the path first)


def log(msg: str) -> None:
    print(f"[serving] {msg}", flush=True)


# ---- the stack ------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args, model: dict) -> list[str]:
    """The engine flags of both the stack (`pdserve up`) and the engine alone."""
    top = max(args.concurrency + [args.prompts_only_concurrency])  # (the prompts-only run's prompts, all at once)
    per_request = -(-(model["input_len"] + model["output_len"]) // args.page_size) + 1
    pages = args.num_pages or int(per_request * top * 1.1) + 64
    flags = ["--model", model["dir"], "--device", args.device, "--load-format", model["load_format"],
             "--page-size", str(args.page_size), "--num-pages", str(pages),
             "--max-running-requests", str(max(top, 1)), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.cuda_graph_max_bs:
        flags += ["--cuda-graph-max-bs", str(args.cuda_graph_max_bs)]
    if args.speculative_num_steps:
        flags += ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(args.speculative_num_steps)]
    return flags + args.engine_arg


def tail_until_up(up: subprocess.Popen, log_path: str, timeout_s: float) -> dict:
    """Wait for "pdserve is up" in the log, echoing the progress lines; returns the start-up times it printed."""
    start, seen = time.monotonic(), 0
    info = {"warmup_s": {}, "worker_ready_s": {}}
    while True:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
        for line in lines[seen:]:
            if any(k in line for k in ("warm-up: done", "serving on", "ready after", "pdserve is up", "still starting",
                                       "Error", "error:")):
                log(f"  up: {line.strip()[:200]}")
            if "warm-up: done in" in line:  # "warm-up: done in 1.23 s (decode worker, ...)"
                seconds, rest = line.split("warm-up: done in")[1].split(" s (", 1)
                info["warmup_s"][rest.split()[0]] = float(seconds)
            ready = re.search(r"\] (\w+) worker \S+ ready after ([\d.]+) s", line)
            if ready:
                info["worker_ready_s"][ready.group(1)] = float(ready.group(2))
            if "pdserve is up" in line:
                info["up_s"] = time.monotonic() - start
                return info
        seen = len(lines)
        if up.poll() is not None:
            raise RuntimeError(f"pdserve up exited ({up.returncode}) before it was up:\n" + "\n".join(lines[-40:]))
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"pdserve up not up within {timeout_s:.0f} s:\n" + "\n".join(lines[-40:]))
        time.sleep(0.05)


def stop(up: subprocess.Popen) -> None:
    if up.poll() is None:
        up.send_signal(signal.SIGINT)
    try:
        up.wait(60)
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait(10)


def run_stack(args, name: str, model: dict, out: str, result: dict, save, log_name: str = "") -> None:
    """Fills `result` as it goes (save() after each measurement); each run's files go to `out`, what `up` printed to
    --out/<log_name> (default <name>_up.log)."""
    log_path = os.path.join(args.out, log_name or f"{name}_up.log")
    trace_dir = os.path.join(out, "trace")  # with --explain-ttft
    t0 = time.monotonic()
    up = None
    try:
        for attempt in range(3):
            port = free_port()
            # No HTTP front, and metrics on free ports (--metrics-port 0): the fixed defaults (8000, 9100+) could be
            # taken on a shared machine. The workers' metrics give each run's KV transfer time and NextN acceptance.
            cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--no-http", "--metrics-port", "0",
                   *engine_flags(args, model), *args.up_arg]
            log(f"{name}: starting the stack: {shlex.join(cmd[1:])}")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if args.explain_ttft:  # every process of the stack timestamps each request's points
                env["PDSERVE_TRACE"] = trace_dir
            up = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
            result["command"] = shlex.join(["python", *cmd[1:]])
            try:
                result.update(tail_until_up(up, log_path, args.start_timeout))
                break
            except RuntimeError as e:
                # NOTE: the port was free when picked, but another process (the last stack's workers, still
                # exiting, hold ports of their own) may take it before `up` binds it: `up` then refuses at once,
                # before any worker starts, and another port is tried.
                if "cannot listen on" not in str(e) or attempt == 2:
                    raise
                log(f"{name}: port {port} was taken before `up` could bind it; trying another")
        log(f"{name}: up after {result['up_s']:.1f} s; warm-up per worker {result['warmup_s']}")
        for i, c in enumerate(args.concurrency):
            n = num_prompts(args, c)
            path = os.path.join(out, f"bench_c{c}.json")
            bench = [sys.executable, "-m", "pdserve", "bench", "--target", f"127.0.0.1:{port}", "--num-prompts", str(n),
                     "--input-len", str(model["input_len"]), "--output-len", str(model["output_len"]),
                     "--max-concurrency", str(c), "--seed", str(i), "--json", path, "--no-progress"]
            t = time.monotonic()
            before = worker_stats(log_path)
            since_ns = time.monotonic_ns()
            proc = subprocess.run(bench, cwd=ROOT, capture_output=True, text=True, timeout=args.bench_timeout)
            if proc.returncode != 0 or not os.path.isfile(path):
                raise RuntimeError(f"pdserve bench failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                   f"{proc.stderr[-3000:]}")
            with open(path) as f:
                r = json.load(f)
            r.update(concurrency=c, seed=i, command=shlex.join(["pdserve", *bench[3:]]),
                     **stats_since(before, worker_stats(log_path)))
            if args.explain_ttft and c == 1:  # (the trace files are line-buffered: complete once bench is done)
                r["ttft_parts"] = trace_report.ttft_parts(trace_report.load(trace_dir), since_ns, time.monotonic_ns())
                log(f"{name}: c=1: where the first token's time went (medians): {r['ttft_parts']}")
            result["runs"].append(r)
            save()
            log(f"{name}: c={c}: {r['completed']}/{n} ok, {r['failed']} failed {r['errors_by_status'] or ''}, "
                f"{r['output_token_throughput']:.0f} out tok/s, {r['input_token_throughput']:.0f} in tok/s, "
                f"TTFT p50 {_ms(r['ttft']['median_ms'])}, ITL {_ms(r['itl']['mean_ms'])}, TPOT "
                f"{_ms(r['tpot']['mean_ms'])}" + (f", decode graph replays {r['replay_stretch']:.2f}x their fastest"
                                                   if r.get("replay_stretch") else "")
                + f" ({time.monotonic() - t:.1f} s)")
        c = args.prompts_only_concurrency
        if c:
            path = os.path.join(out, "bench_prompts_only.json")
            bench = [sys.executable, "-m", "pdserve", "bench", "--target", f"127.0.0.1:{port}", "--num-prompts",
                     str(num_prompts(args, c)), "--input-len", str(model["input_len"]), "--output-len", "1",
                     "--max-concurrency", str(c), "--seed", str(PROMPTS_ONLY_SEED), "--json", path, "--no-progress"]
            proc = subprocess.run(bench, cwd=ROOT, capture_output=True, text=True, timeout=args.bench_timeout)
            if proc.returncode != 0 or not os.path.isfile(path):
                raise RuntimeError(f"pdserve bench (prompts only) failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
            with open(path) as f:
                r = json.load(f)
            r.update(concurrency=c, seed=PROMPTS_ONLY_SEED, command=shlex.join(["pdserve", *bench[3:]]))
            result["prompts_only"] = r
            save()
            log(f"{name}: prompts only, c={c}: {r['completed']} ok, {r['failed']} failed, "
                f"{r['input_token_throughput']:.0f} in tok/s, TTFT p50 {_ms(r['ttft']['median_ms'])}")
    finally:
        if up is not None:
            stop(up)
        result["stack_s"] = time.monotonic() - t0


# The workers' histograms read around each run (benchmarks/stage_times.py): the KV transfer time per request (the
# prefill worker's: from its answer to the decode worker's confirmation), NextN's tokens per verification row, and
# how stretched the decode worker's graph replays were by the GPU's other process (when it paces by GPU share).
WORKER_SERIES = ("pdserve_kv_transfer_seconds", "pdserve_spec_accept_length", "pdserve_decode_replay_stretch")


def worker_stats(up_log: str) -> Optional[dict]:
    """A snapshot of WORKER_SERIES from every worker `up` started (None where the metrics could not be read)."""
    from benchmarks.stage_times import snapshot

    try:
        return snapshot(up_log, WORKER_SERIES)
    except OSError as e:  # (URLError is one) the run goes on without them; its row says "-"
        log(f"could not read the workers' metrics: {e}")
        return None


def stats_since(before: Optional[dict], after: Optional[dict]) -> dict:
    """{"transfer_ms": mean KV transfer time, "accept_length": NextN tokens per verification row, "replay_stretch":
    mean decode graph replay time over its fastest} over a run (None where not measured)."""
    from benchmarks.stage_times import interval_means

    means = interval_means(before, after) if before is not None and after is not None else {}

    def mean_of(metric: str) -> Optional[float]:  # over every label set of the metric (one transport per run)
        rows = [(m, n) for key, (m, n) in means.items() if key.split("{")[0] == metric]
        return sum(m * n for m, n in rows) / sum(n for _, n in rows) if rows else None

    transfer = mean_of("pdserve_kv_transfer_seconds")
    return {"transfer_ms": None if transfer is None else 1e3 * transfer,
            "accept_length": mean_of("pdserve_spec_accept_length"),
            "replay_stretch": mean_of("pdserve_decode_replay_stretch")}


# The idle gaps before the timed gRPC messages of --explain-ttft: a process busy with the decode (the client and the
# router at c=1), and one idle through it (the prefill worker: about the demo model's decode between two prompts).
HOP_GAPS_S = (0.002, 0.11)

PROMPTS_ONLY_SEED = 100  # the prompts-only run's prompts, the same on both sides (none shared with the other runs)


def num_prompts(args, c: int) -> int:
    return args.num_prompts or max(8, 2 * c)


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f} ms"


# ---- the engine alone (its own process: the stack's GPU memory is free again, and its own is freed at exit) ----------
def run_engine_process(args, name: str, model: dict, out: str) -> dict:
    path = os.path.join(out, "engine.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--engine-only", path, "--out", out,
           "--input-len", str(model["input_len"]), "--output-len", str(model["output_len"]),
           "--concurrency", *map(str, args.concurrency), "--device", args.device,
           "--prompts-only-concurrency", str(args.prompts_only_concurrency),
           *(["--num-prompts", str(args.num_prompts)] if args.num_prompts else []),
           "--", *engine_flags(args, model)]
    log(f"{name}: the engine alone: {shlex.join(cmd[1:])}")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, timeout=args.bench_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the engine-alone run failed ({proc.returncode})")
    with open(path) as f:
        r = json.load(f)
    r["seconds"] = time.monotonic() - t0
    return r


def engine_only(args) -> None:
    """In the child process: the engine alone on the bench's prompts."""
    import random

    from pdserve.cli.bench import add_bench_args, make_prompts
    from pdserve.cli.engine_args import add_engine_args, engine_config_from_args
    from pdserve.engine import LLMEngine
    from pdserve.sampling import SamplingParams
    from pdserve.serving.warmup import plan_for, warm_up
    import dataclasses

    import torch

    p = argparse.ArgumentParser()
    add_engine_args(p)
    eargs = p.parse_args(args.engine_flags)
    config = engine_config_from_args(eargs)
    # No prefix cache: the prompts share nothing, and one prompt timed three times must not hit its own pages.
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, enable_prefix_cache=False))
    t0 = time.monotonic()
    engine = LLMEngine(config)
    built = time.monotonic() - t0
    report = warm_up(engine, plan_for(engine, "engine"))
    log(f"engine built in {built:.1f} s, warmed up in {report.seconds:.1f} s")
    vocab = engine.model_config.vocab_size
    gpu = torch.cuda.get_device_name() if str(config.device).startswith("cuda") else "cpu"

    def prompts_of(seed: int, n: int) -> list[list[int]]:
        b = argparse.ArgumentParser()
        add_bench_args(b)
        bargs = b.parse_args(["--num-prompts", str(n), "--input-len", str(args.input_len), "--output-len",
                              str(args.output_len), "--seed", str(seed)])
        return [ids for ids, _ in make_prompts(bargs, vocab, random.Random(seed))]

    def timed_generate(prompts: list[list[int]], new_tokens: int) -> dict:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        pending_first, steps = set(ids), []
        start = time.perf_counter()
        all_first = None
        while engine.has_unfinished:
            t = time.perf_counter()
            outs = engine.step()  # ends with the sampled tokens on the host: the step's GPU work is done
            prefill = bool(pending_first)
            pending_first.difference_update(o.request_id for o in outs)
            steps.append((time.perf_counter() - t, prefill))
            if prefill and not pending_first:
                all_first = time.perf_counter()
        total = time.perf_counter() - start
        decode = [s for s, prefill in steps if not prefill]
        prefill_s = sum(s for s, prefill in steps if prefill)
        return {"seconds": total, "prefill_s": prefill_s, "steps": len(steps),
                "max_step_ms": 1e3 * max(s for s, _ in steps),  # a kernel compiled in the timed run shows here
                "decode_step_ms": 1e3 * statistics.median(decode) if decode else None,
                "tpot_ms": 1e3 * (start + total - all_first) / (new_tokens - 1) if new_tokens > 1 else None,
                "output_tok_s": len(prompts) * new_tokens / total,
                "prefill_tok_s": sum(map(len, prompts)) / prefill_s if prefill_s else None}

    def one_at_a_time(prompts: list[list[int]]) -> dict:
        """Each of the stack's concurrency-1 prompts alone, as `pdserve bench` sent them (with NextN the time per
        token depends on the text, through the drafts it accepts), twice: the second pass is reported."""
        first = [timed_generate([p], args.output_len) for p in prompts]
        spec = engine.speculator
        rows0, emitted0 = (spec.num_rows, spec.num_emitted) if spec is not None else (0, 0)
        runs = [timed_generate([p], args.output_len) for p in prompts]
        decode = [x["decode_step_ms"] for x in runs if x["decode_step_ms"] is not None]
        tpots = [x["tpot_ms"] for x in runs if x["tpot_ms"] is not None]
        total = sum(x["seconds"] for x in runs)
        return {"seconds": total, "steps": sum(x["steps"] for x in runs), "prompts": len(prompts),
                "max_step_ms": max(x["max_step_ms"] for x in runs),
                "decode_step_ms": statistics.median(decode) if decode else None,
                "tpot_ms": statistics.mean(tpots) if tpots else None,  # as pdserve bench's TPOT: a mean of requests
                "output_tok_s": len(prompts) * args.output_len / total,
                "prefill_tok_s": sum(map(len, prompts)) / sum(x["prefill_s"] for x in runs),
                "prefill_one_ms": 1e3 * statistics.median(x["prefill_s"] for x in runs),  # as TTFT's p50
                "accept_length": ((spec.num_emitted - emitted0) / (spec.num_rows - rows0)
                                  if spec is not None and spec.num_rows > rows0 else None),
                "first_pass": {"seconds": sum(x["seconds"] for x in first),
                               "max_step_ms": max(x["max_step_ms"] for x in first),
                               "output_tok_s": len(prompts) * args.output_len / sum(x["seconds"] for x in first)}}

    result = {"gpu": gpu, "engine_flags": args.engine_flags, "built_s": built, "warmup_s": report.seconds,
              "batches": []}
    for i, c in enumerate(args.concurrency):
        if c == 1:  # the rows of the TPOT and TTFT targets: the very prompts the stack ran
            r = one_at_a_time(prompts_of(i, num_prompts(args, 1)))
            r.update(batch=1, seed=i)
            result["batches"].append(r)
            log(f"engine: {r['prompts']} prompts one at a time: {r['output_tok_s']:.0f} out tok/s, decode step "
                f"{_ms(r['decode_step_ms'])}, TPOT {_ms(r['tpot_ms'])}, prefill of one prompt (median) "
                f"{r['prefill_one_ms']:.2f} ms" + (f", {r['accept_length']:.2f} tokens per NextN round"
                                                   if r["accept_length"] else ""))
            continue
        prompts = prompts_of(i, max(c, 3))
        singles = [timed_generate([prompts[j]], 1)["seconds"] for j in range(3)]
        # Twice, the second one reported: whatever the warm-up missed (a kernel for a shape it did not run) is
        # compiled in the first, which the stack's warm-up would not have been spared (the stack reports it).
        first = timed_generate(prompts[:c], args.output_len)
        r = timed_generate(prompts[:c], args.output_len)
        r.update(batch=c, seed=i, prefill_one_ms=1e3 * statistics.median(singles),
                 first_pass={k: first[k] for k in ("seconds", "max_step_ms", "output_tok_s")})
        result["batches"].append(r)
        log(f"engine: batch {c}: {r['output_tok_s']:.0f} out tok/s, decode step {_ms(r['decode_step_ms'])}, TPOT "
            f"{_ms(r['tpot_ms'])}, prefill {r['prefill_tok_s'] or 0:.0f} tok/s, one prompt "
            f"{r['prefill_one_ms']:.2f} ms")
    c = args.prompts_only_concurrency
    if c:
        prompts = prompts_of(PROMPTS_ONLY_SEED, c)
        timed_generate(prompts, 1)  # (as above: the second pass is reported)
        r = timed_generate(prompts, 1)
        result["prompts_only"] = {"batch": c, "prefill_tok_s": r["prefill_tok_s"], "seconds": r["seconds"]}
        log(f"engine: prompts only, batch {c}: prefill {r['prefill_tok_s'] or 0:.0f} tok/s")
    with open(args.engine_only, "w") as f:
        json.dump(result, f, indent=2)


# ---- main ------------------------------------------------------------------------------------------------------------
def write_v3_config(out: str, layers: int) -> str:
    from benchmarks.bench_one_batch import FP8, V3

    d = os.path.join(out, f"v3-slice-{layers}L")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(dict(V3, num_hidden_layers=layers, quantization_config=FP8, architectures=["DeepseekV3ForCausalLM"]),
                  f, indent=2)
    return d


def clear_kernel_caches() -> list[str]:
    """What a fresh machine lacks: Triton's compiled kernels and FlashInfer's JIT modules."""
    dirs = [os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")]
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
    dirs.append(os.path.join(base, ".cache", "flashinfer"))
    cleared = []
    for d in dirs:
        if os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)
            cleared.append(d)
    return cleared


def machine() -> dict:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        gpu = []
    # NOTE: BENCH_GIT_REV names the revision where the checkout's own .git does not (a copied working tree).
    rev = os.environ.get("BENCH_GIT_REV") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                            capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return {"gpu": gpu[0] if gpu else "none", "git": rev.strip() + ("+dirty" if dirty else ""),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for serving.json, serving.md and each model's files")
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", nargs="+", default=["demo", "v3"], choices=["demo", "v3"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--num-prompts", type=int, default=None, help="per concurrency (default max(8, 2 x concurrency))")
    p.add_argument("--demo-input-len", type=int, default=512)
    p.add_argument("--demo-output-len", type=int, default=128)
    p.add_argument("--v3-input-len", type=int, default=2048)
    p.add_argument("--v3-output-len", type=int, default=64)
    p.add_argument("--v3-layers", type=int, default=4, help="main layers of the V3 slice (first one dense), + NextN")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None, help="default: room for every request at the top concurrency")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prompts-only-concurrency", type=int, default=32,
                   help="a run of prompts with 1 new token each at this concurrency, for the input tok/s target "
                        "(0: none)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="default pdserve's (64): bigger batches decode eagerly, in the stack and the engine alike")
    p.add_argument("--speculative-num-steps", type=int, default=0, help="NextN with k steps on both sides (0: off)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="one more engine flag for both sides, e.g. --engine-arg=--attention-backend=triton")
    p.add_argument("--up-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for the stack only (`pdserve up`), e.g. --up-arg=--decode-min-step-interval-ms=15")
    p.add_argument("--work-dir", default=None, help="each run's files (default: a temporary folder)")
    p.add_argument("--cold", action="store_true", help="clear the Triton and FlashInfer caches first")
    p.add_argument("--skip-engine", action="store_true", help="the stack only")
    p.add_argument("--repeats", type=int, default=1,
                   help="fresh stack, then the engine alone, this many times per model: each ratio's median and "
                        "range, the targets judged on the medians (host-bound ratios move between stacks)")
    p.add_argument("--explain-ttft", action="store_true",
                   help="say where the c=1 TTFT goes: the stack traced (PDSERVE_TRACE, per-request marks) and its "
                        "first tokens' time split between the router, the prefill step and the hops; and this host's "
                        "bare gRPC message between two processes after 2 and 110 ms idle (benchmarks/grpc_hop.py)")
    p.add_argument("--hop-calls", type=int, default=30, help="with --explain-ttft: gRPC messages timed per kind")
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument("--bench-timeout", type=float, default=400.0, help="seconds per pdserve bench / engine run")
    # Internal: the engine-alone child process.
    p.add_argument("--engine-only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--input-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--output-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("engine_flags", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repeats < 1 or args.hop_calls < 1:
        p.error("--repeats and --hop-calls: at least 1")
    # The engine runs c prompts at once at batch c: a stack sent fewer would never hold c requests, and the two
    # sides would not compare.
    top = max([*args.concurrency, args.prompts_only_concurrency])
    if args.num_prompts is not None and args.num_prompts < top and not args.engine_only:
        p.error(f"--num-prompts {args.num_prompts} is below the concurrency {top}: the stack would never hold that "
                f"many requests while the engine runs {top} at once; give at least {top} (or leave it out: "
                "max(8, 2 x concurrency))")
    if args.engine_only:
        engine_only(args)
        return

    os.makedirs(args.out, exist_ok=True)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-serving-")
    command = shlex.join(["python", "benchmarks/bench_serving.py", *sys.argv[1:]])
    result = {"command": command, **machine(), "device": args.device, "cold": args.cold, "models": {}}
    log(f"{command}\n[serving] {result['gpu']}, git {result['git']}, {result['date']}")
    # The CPUs' speed spread at the start and the end: host-bound numbers (the demo model's) move with it.
    result["host_speed"] = {"start": host_speed.summary(host_speed.per_cpu_loop_ms())}
    log(f"host at the start: {host_speed.describe(result['host_speed']['start'])}")
    if args.explain_ttft:
        # A first token at c=1 crosses four process hops in a row: what each costs bare, between busy processes and
        # between idle ones (HOP_GAPS_S).
        result["grpc_hop"] = {"calls": args.hop_calls, "rows": grpc_hop.measure(list(HOP_GAPS_S), args.hop_calls,
                                                                           8192)}
        log(f"this host's bare gRPC hop: {result['grpc_hop']['rows']}")
    if args.cold:
        result["cleared_caches"] = clear_kernel_caches()
        log(f"cold start: cleared {result['cleared_caches'] or 'nothing (no caches yet)'}")
    models = {"demo": {"dir": DEMO_MODEL, "load_format": "auto", "input_len": args.demo_input_len,
                       "output_len": args.demo_output_len},
              "v3": {"dir": None, "load_format": "dummy", "input_len": args.v3_input_len,
                     "output_len": args.v3_output_len}}
    t0 = time.monotonic()

    def save() -> None:  # after every measurement: a run cut short by its time limit keeps what it measured
        write_results(result, args, command, t0)

    try:
        for name in args.models:
            model = models[name]
            out = os.path.join(work, name)
            os.makedirs(out, exist_ok=True)
            if name == "v3":
                model["dir"] = write_v3_config(out, args.v3_layers)
            entry = result["models"][name] = {"model": model, "stack": {"runs": []}}
            try:
                for k in range(1, args.repeats + 1):  # the first repeat is the entry itself; the others follow it
                    rep = entry if k == 1 else {"stack": {"runs": []}}
                    if k > 1:
                        entry.setdefault("more_repeats", []).append(rep)
                        log(f"{name}: repeat {k} of {args.repeats}")
                    rep_out = out if k == 1 else os.path.join(out, f"r{k}")
                    os.makedirs(rep_out, exist_ok=True)
                    run_stack(args, name, model, rep_out, rep["stack"], save,
                              f"{name}_up.log" if k == 1 else f"{name}_up_r{k}.log")
                    if not args.skip_engine:
                        rep["engine"] = run_engine_process(args, name, model, rep_out)
                    save()
            except Exception as e:  # noqa: BLE001 - recorded, and the next model still runs
                entry["error"] = f"{type(e).__name__}: {e}"
                log(f"{name} FAILED: {entry['error'][-3000:]}")
            save()
            log(f"{name} done after {time.monotonic() - t0:.0f} s")
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    result["host_speed"]["end"] = host_speed.summary(host_speed.per_cpu_loop_ms())
    log(f"host at the end: {host_speed.describe(result['host_speed']['end'])}")
    text = write_results(result, args, command, t0)
    print(text, flush=True)
    log(f"wrote {args.out}/serving.json and serving.md in {time.monotonic() - t0:.0f} s")
    if any("error" in e for e in result["models"].values()):
        sys.exit(1)


def write_results(result: dict, args, command: str, t0: float) -> str:
    """serving.json and serving.md in --out (after every measurement: a run cut short keeps what it measured)."""
    summarize(result)
    result["seconds"] = time.monotonic() - t0
    hosts = result.get("host_speed", {})
    host_line = ("Host CPUs, " + "; ".join(f"at the {when}: {host_speed.describe(s)}" for when, s in hosts.items())
                 + " (host-bound numbers, the demo model's, follow the CPU a thread lands on)") if hosts else ""
    text = markdown(result, command, args.device, args.cold, args.prompts_only_concurrency, args.repeats, host_line)
    with open(os.path.join(args.out, "serving.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "serving.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    main()
