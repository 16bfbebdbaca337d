"""`pdserve bench`: a load generator for a running router, in the style of sglang.bench_serving.

Random prompts of token ids (lengths drawn from [len * range_ratio, len]), optionally built on shared prefixes;
arrivals at a Poisson rate (or all at once) and/or capped by a concurrency limit. Every request ends with its
tokens or a status; the report gives request and token throughput, TTFT / ITL / TPOT / E2E mean, median and p99, and
errors by status, as a table and optionally JSON. ITL is per token: a message carrying n tokens counts n gaps of
1/n of its wait each (as SGLang's bench_serving does), so it stays comparable to a decode step.

    pdserve bench --target localhost:50051 --num-prompts 200 --input-len 256 --output-len 64 --request-rate 8
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
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Outcome:
    """One request as the client saw it."""

    prompt_len: int
    status: str = "NO_FINAL_STATUS"  # "OK" or a gRPC status name; stays this only if the stream just stopped
    output_len: int = 0
    ttft: Optional[float] = None
    itls: list[float] = field(default_factory=list)
    e2e: Optional[float] = None
    error: str = ""


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT", help="router address")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens, at most (default 128)")
    p.add_argument("--output-len", type=int, default=32, help="new tokens, at most (default 32)")
    p.add_argument("--range-ratio", type=float, default=1.0,
                   help="lengths are uniform in [len * ratio, len] (default 1.0: exactly len)")
    p.add_argument("--shared-prefix-groups", type=int, default=0, metavar="G",
                   help="prompts start with one of G random shared prefixes (default 0: none)")
    p.add_argument("--shared-prefix-len", type=int, default=0, metavar="N", help="tokens per shared prefix")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each request in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY'")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="dial the router over TLS trusting this CA")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


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


async def one_request(stub, ids: list[int], max_new: int, timeout: float, metadata) -> Outcome:
    import grpc

    from pdserve.v1 import generate_pb2 as gen_pb

    req = gen_pb.GenerateRequest(tokenized=gen_pb.TokenizedInput(input_ids=ids),
                                 sampling_params=gen_pb.SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    out = Outcome(len(ids))
    start = last = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout, metadata=metadata):
            now = time.perf_counter()
            if msg.HasField("chunk") and msg.chunk.token_ids:
                if out.ttft is None:
                    out.ttft = now - start
                else:  # a message of n tokens (--stream-interval, a router catching up): n gaps of 1/n each,
                    n = len(msg.chunk.token_ids)  # as SGLang's bench_serving counts them
                    out.itls.extend([(now - last) / n] * n)
                last = now
            elif msg.HasField("complete"):
                out.output_len = len(msg.complete.output_ids)
                out.e2e, out.status = now - start, "OK"
    except grpc.aio.AioRpcError as e:
        out.status, out.error = e.code().name, e.details() or ""
    return out


async def run(args: argparse.Namespace) -> dict:
    # NOTE: imported here so that `pdserve --help` does not load gRPC.
    import grpc

    from pdserve.serving.auth import bearer_metadata
    from pdserve.v1 import generate_pb2 as gen_pb
    from pdserve.v1 import generate_pb2_grpc as gen_grpc

    md = bearer_metadata(args.api_key)
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            channel = grpc.aio.secure_channel(args.target, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.aio.insecure_channel(args.target)
    async with channel:
        stub = gen_grpc.GenerationStub(channel)
        info = await stub.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=30, metadata=md)
        rng = random.Random(args.seed)
        prompts = make_prompts(args, info.vocab_size, rng)
        limit = asyncio.Semaphore(args.max_concurrency or len(prompts) or 1)
        done: list[Outcome] = []

        async def limited(ids, max_new) -> None:
            async with limit:
                done.append(await one_request(stub, ids, max_new, args.request_timeout, md))
            if not args.no_progress:
                failed = sum(o.status != "OK" for o in done)
                print(f"\r[bench] {len(done)}/{len(prompts)} done, {failed} failed", end="", file=sys.stderr,
                      flush=True)

        start = time.perf_counter()
        tasks = []
        for ids, max_new in prompts:
            tasks.append(asyncio.create_task(limited(ids, max_new)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if not args.no_progress:
            print(file=sys.stderr)
    return summarize(done, duration, args)


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean_ms": 1e3 * statistics.fmean(values), "median_ms": 1e3 * statistics.median(values),
            "p99_ms": 1e3 * p99}


def summarize(outcomes: list[Outcome], duration: float, args: argparse.Namespace) -> dict:
    ok = [o for o in outcomes if o.status == "OK"]
    out_tokens, in_tokens = sum(o.output_len for o in ok), sum(o.prompt_len for o in ok)
    tpots = [(o.e2e - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1 and o.ttft is not None]
    errors = Counter(o.status for o in outcomes if o.status != "OK")
    return {
        "target": args.target, "num_prompts": args.num_prompts, "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "duration_s": duration, "completed": len(ok),
        "failed": len(outcomes) - len(ok), "no_final_status": errors.get("NO_FINAL_STATUS", 0),
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


def cmd_bench(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if not 0 < args.range_ratio <= 1:
        raise ValueError(f"--range-ratio must be in (0, 1], got {args.range_ratio}")
    if (args.shared_prefix_groups > 0) != (args.shared_prefix_len > 0):
        raise ValueError("--shared-prefix-groups and --shared-prefix-len go together")
    result = asyncio.run(run(args))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
