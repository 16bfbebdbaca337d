"""`pdserve bench`: a load generator for a running router, in the style of sglang.bench_serving.

Random prompts of token ids (lengths drawn from [len * range_ratio, len]), optionally built on shared prefixes;
arrivals at a Poisson rate (or all at once) and/or capped by a concurrency limit. Every request ends with its
tokens or a status; the report gives request and token throughput, TTFT / ITL / TPOT / E2E mean, median and p99, and
errors by status, as a table and optionally JSON. It drives either front of the router, gRPC (HOST:PORT) or the
OpenAI HTTP API (http://HOST:PORT), timing both alike (pdserve/cli/bench_clients.py).

Several values of --request-rate or of --max-concurrency are a sweep: one run per value, one after another, then a
table of every run and, with --plot, a PNG of TTFT, TPOT and output throughput against the load.

    pdserve bench --target localhost:50051 --num-prompts 200 --input-len 256 --output-len 64 --request-rate 8
    pdserve bench --target http://localhost:8000 --max-concurrency 1 4 16 --plot sweep.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from pdserve.cli.bench_clients import Outcome, client_for, one_request  # noqa: F401  (one_request: tests use it)
from pdserve.cli.engine_args import UsageError


@dataclass(frozen=True)
class Load:
    """One run's offered load."""

    request_rate: float  # requests per second, Poisson arrivals; inf: all at once
    max_concurrency: Optional[int]  # requests in flight at most; None: no cap


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT|URL",
                   help="the router: HOST:PORT for its gRPC API, or http://HOST:PORT for its OpenAI HTTP API "
                        "(default 127.0.0.1:50051)")
    p.add_argument("--backend", default=None, choices=["grpc", "openai"],
                   help="grpc (pdserve.v1.Generation) or openai (streamed /v1/completions); default: openai for an "
                        "http:// or https:// target, else grpc")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="openai backend: the model directory whose config.json's vocab_size bounds the prompts' "
                        "random token ids, which the HTTP API does not report (default: the demo model, "
                        "models/tiny-trained); the gRPC API reports it")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per run (default 100)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens, at most (default 128)")
    p.add_argument("--output-len", type=int, default=32, help="new tokens, at most (default 32)")
    p.add_argument("--range-ratio", type=float, default=1.0,
                   help="lengths are uniform in [len * ratio, len] (default 1.0: exactly len)")
    p.add_argument("--shared-prefix-groups", type=int, default=0, metavar="G",
                   help="prompts start with one of G random shared prefixes (default 0: none)")
    p.add_argument("--shared-prefix-len", type=int, default=0, metavar="N", help="tokens per shared prefix")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], metavar="R",
                   help="requests per second, Poisson arrivals (default inf: all at once); several values: one run "
                        "per rate, in order")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=None, metavar="N",
                   help="requests in flight at most (default: no cap); several values: one run per value, in order")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each request in seconds")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts and arrival times; run k of a sweep uses SEED + k, so that no run "
                        "finds another's prompts in the prefix cache (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (a sweep: every run)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write a PNG of TTFT, TPOT and output throughput against the load of each run (needs "
                        "matplotlib)")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY'")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="dial the router over TLS trusting this CA")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def load_points(args: argparse.Namespace) -> tuple[Optional[str], list[Load]]:
    """(the swept setting or None, one Load per run). A sweep varies one setting; the other keeps one value."""
    rates, caps = list(args.request_rate), list(args.max_concurrency or [None])
    if len(rates) > 1 and len(caps) > 1:
        raise UsageError("sweep one of --request-rate and --max-concurrency: give the other one value")
    if any(not (r > 0) for r in rates):
        raise UsageError(f"--request-rate must be > 0 (inf: all at once), got {' '.join(map(str, rates))}")
    if any(c is not None and c < 1 for c in caps):
        raise UsageError(f"--max-concurrency must be >= 1, got {' '.join(map(str, caps))}")
    swept = "request_rate" if len(rates) > 1 else "max_concurrency" if len(caps) > 1 else None
    return swept, [Load(r, c) for r in rates for c in caps]


def make_prompts(args: argparse.Namespace, vocab_size: int, rng: random.Random) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) per request. Ids avoid 0..9, where tiny/special tokens tend to live."""
    def lengths(n: int) -> int:
        return rng.randint(max(1, int(n * args.range_ratio)), n)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab_size) for _ in range(n)]

    prefixes = [tokens(args.shared_prefix_len) for _ in range(args.shared_prefix_groups)]
    out = []
    for i in range(args.num_prompts):
        prefix = prefixes[i % len(prefixes)] if prefixes else []
        out.append((prefix + tokens(lengths(args.input_len)), lengths(args.output_len)))
    return out


async def run_load(client, args: argparse.Namespace, load: Load, seed: int, vocab_size: int,
                   label: str = "bench") -> dict:
    """One run at `load` through an open client; its summary."""
    rng = random.Random(seed)
    prompts = make_prompts(args, vocab_size, rng)
    limit = asyncio.Semaphore(load.max_concurrency or len(prompts) or 1)
    done: list[Outcome] = []

    async def limited(ids, max_new) -> None:
        async with limit:
            done.append(await client.request(ids, max_new, args.request_timeout))
        if not args.no_progress:
            failed = sum(o.status != "OK" for o in done)
            print(f"\r[{label}] {len(done)}/{len(prompts)} done, {failed} failed", end="", file=sys.stderr,
                  flush=True)

    start = time.perf_counter()
    tasks = []
    for ids, max_new in prompts:
        tasks.append(asyncio.create_task(limited(ids, max_new)))
        if math.isfinite(load.request_rate):
            await asyncio.sleep(rng.expovariate(load.request_rate))  # Poisson arrivals
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if not args.no_progress:
        print(file=sys.stderr)
    return summarize(done, duration, args, load, client.backend)


async def run_loads(args: argparse.Namespace, loads: list[Load], swept: Optional[str] = None,
                    on_result=None) -> list[dict]:
    """Every load, one after another, over one client; on_result(summary) after each run."""
    client = client_for(args)
    vocab_size = await client.open()
    results = []
    try:
        for k, load in enumerate(loads):
            label = f"bench {swept}={_value(getattr(load, swept))}" if swept else "bench"
            results.append(await run_load(client, args, load, args.seed + k, vocab_size, label))
            if on_result is not None:
                on_result(results[-1])
    finally:
        await client.close()
    return results


async def run(args: argparse.Namespace) -> dict:
    """One run at the single load `args` give (what tests and benchmarks/ call)."""
    swept, loads = load_points(args)
    if swept:
        raise UsageError(f"run() measures one load; --{swept.replace('_', '-')} has several values")
    return (await run_loads(args, loads))[0]


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean_ms": 1e3 * statistics.fmean(values), "median_ms": 1e3 * statistics.median(values),
            "p99_ms": 1e3 * p99}


def summarize(outcomes: list[Outcome], duration: float, args: argparse.Namespace, load: Load,
              backend: str) -> dict:
    ok = [o for o in outcomes if o.status == "OK"]
    out_tokens, in_tokens = sum(o.output_len for o in ok), sum(o.prompt_len for o in ok)
    tpots = [(o.e2e - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1 and o.ttft is not None]
    errors = Counter(o.status for o in outcomes if o.status != "OK")
    return {
        "target": args.target, "backend": backend, "num_prompts": args.num_prompts,
        "request_rate": load.request_rate, "max_concurrency": load.max_concurrency, "duration_s": duration,
        "completed": len(ok), "failed": len(outcomes) - len(ok), "no_final_status": errors.get("NO_FINAL_STATUS", 0),
        "errors_by_status": dict(errors),
        "error_examples": {status: next(o.error for o in outcomes if o.status == status) for status in errors},
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_token_throughput": in_tokens / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "ttft": _stats([o.ttft for o in ok if o.ttft is not None]),
        "itl": _stats([x for o in ok for x in o.itls]),
        "tpot": _stats(tpots),
        "e2e": _stats([o.e2e for o in ok]),
    }


def format_table(r: dict) -> str:
    rows = [("Completed requests", r["completed"]), ("Failed requests", r["failed"]),
            ("Without a final status", r["no_final_status"]), ("Duration (s)", f"{r['duration_s']:.2f}"),
            ("Input tokens", r["total_input_tokens"]), ("Output tokens", r["total_output_tokens"]),
            ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
            ("Input token throughput (tok/s)", f"{r['input_token_throughput']:.1f}"),
            ("Output token throughput (tok/s)", f"{r['output_token_throughput']:.1f}")]
    for name in ("ttft", "itl", "tpot", "e2e"):
        for stat in ("mean_ms", "median_ms", "p99_ms"):
            v = r[name][stat]
            rows.append((f"{name.upper()} {stat.replace('_ms', '')} (ms)", "-" if v is None else f"{v:.2f}"))
    for status, n in sorted(r["errors_by_status"].items()):
        rows.append((f"Errors {status}", n))
    width = max(len(k) for k, _ in rows) + 2
    bar = "=" * (width + 14)
    return "\n".join([bar, " pdserve bench ".center(width + 14, "="), *(f"{k:<{width}}{v:>14}" for k, v in rows),
                      bar])


def _value(v) -> str:
    """A load setting as the tables and the plot show it."""
    if v is None:
        return "none"
    return "inf" if v == math.inf else f"{v:g}"


SWEEP_COLUMNS = (("completed", "ok", "{:d}"), ("failed", "failed", "{:d}"),
                 ("request_throughput", "req/s", "{:.2f}"), ("output_token_throughput", "out tok/s", "{:.1f}"),
                 ("ttft.mean_ms", "TTFT mean", "{:.1f}"), ("ttft.p99_ms", "TTFT p99", "{:.1f}"),
                 ("tpot.mean_ms", "TPOT mean", "{:.2f}"), ("itl.mean_ms", "ITL mean", "{:.2f}"),
                 ("e2e.mean_ms", "E2E mean", "{:.1f}"))


def _field(r: dict, key: str):
    for part in key.split("."):
        r = r[part]
    return r


def format_sweep(swept: str, results: list[dict]) -> str:
    """One row per run: the swept setting, then throughput and latency (times in ms)."""
    head = [swept.replace("_", " ")] + [title for _, title, _ in SWEEP_COLUMNS]
    rows = [[_value(r[swept])] + ["-" if _field(r, k) is None else fmt.format(_field(r, k))
                                  for k, _, fmt in SWEEP_COLUMNS] for r in results]
    widths = [max(len(line[i]) for line in [head, *rows]) + 2 for i in range(len(head))]
    lines = ["".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [head, *rows]]
    bar = "=" * len(lines[0])
    return "\n".join([bar, " pdserve bench sweep (times in ms) ".center(len(bar), "="), *lines, bar])


def plot(path: str, swept: Optional[str], results: list[dict]) -> None:
    """TTFT, TPOT (mean and p99) and output throughput against each run's load, as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    def load_label(r: dict) -> str:
        if swept:
            return _value(r[swept])
        return f"rate {_value(r['request_rate'])}, cap {_value(r['max_concurrency'])}"

    x = list(range(len(results)))
    fig = Figure(figsize=(14, 4.2), layout="constrained")
    panels = (("TTFT (ms)", [("mean", "ttft.mean_ms"), ("p99", "ttft.p99_ms")]),
              ("TPOT (ms)", [("mean", "tpot.mean_ms"), ("p99", "tpot.p99_ms")]),
              ("output throughput (tok/s)", [("output", "output_token_throughput")]))
    for ax, (title, series) in zip(fig.subplots(1, len(panels)), panels):
        for name, key in series:
            ys = [math.nan if _field(r, key) is None else _field(r, key) for r in results]
            ax.plot(x, ys, marker="o", label=name)
        ax.set_xticks(x, [load_label(r) for r in results])
        ax.set_xlabel({"request_rate": "request rate (req/s)", "max_concurrency": "max concurrency"}.get(swept, "load"))
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    first = results[0]
    fig.suptitle(f"pdserve bench: {first['backend']} {first['target']}, {first['num_prompts']} requests per run")
    fig.savefig(path, dpi=100)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise UsageError("--num-prompts, --input-len and --output-len must be >= 1")
    if not 0 < args.range_ratio <= 1:
        raise UsageError(f"--range-ratio must be in (0, 1], got {args.range_ratio}")
    if (args.shared_prefix_groups > 0) != (args.shared_prefix_len > 0):
        raise UsageError("--shared-prefix-groups and --shared-prefix-len go together")
    swept, loads = load_points(args)
    if args.plot:  # checked before the runs, which may take long
        try:
            import matplotlib.figure  # noqa: F401
        except ImportError as e:
            raise UsageError(f"--plot {args.plot}: matplotlib does not import here ({e}); pip install matplotlib, "
                             "or leave out --plot") from None
    results = asyncio.run(run_loads(args, loads, swept, on_result=lambda r: print(format_table(r), flush=True)))
    if swept:
        print(format_sweep(swept, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sweep": swept, "runs": results} if swept else results[0], f, indent=2)
    if args.plot:
        plot(args.plot, swept, results)
        print(f"wrote {args.plot}")
    return 0
