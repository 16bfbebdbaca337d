"""Resident memory of each pdserve process over many short requests: a leak keeps growing phase after phase, warm-up
(KV pool pages touched for the first time, allocator caches) levels off. Prints one line per phase.

    python benchmarks/bench_worker_rss.py --model models/tiny-trained --phases 4 --requests 3000

Starts 1 prefill + 1 decode worker and a router (real processes, free ports, the CLI's pool size), sends each
phase's requests (distinct short prompts, so the prefix cache keeps taking new pages) at --concurrency, and reads
VmRSS from /proc after each phase. The KV pool's size is printed beside it: RSS may grow by up to that much before
every page has been written once: growth that stops after the first phase is warm-up (the prefix cache's
pool pages written for the first time, allocator caches for each batch shape), growth in every phase a leak.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from stack import start_stack  # noqa: E402  (the tests' process launcher)

from pdserve.v1 import generate_pb2 as gen_pb  # noqa: E402
from pdserve.v1 import generate_pb2_grpc as gen_grpc  # noqa: E402
from pdserve.v1 import worker_pb2 as pb  # noqa: E402
from pdserve.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def pool_mb(address: str, stub_cls) -> float:
    with grpc.insecure_channel(address) as ch:
        stub = stub_cls(ch)
        info = stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=10)
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    lay = info.layout
    return load.num_total_pages * lay.page_size * lay.num_kv_layers * lay.kv_dim * DTYPE_BYTES[lay.dtype] / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3000, help="per phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16, help="default: the CLI's")
    ap.add_argument("--num-pages", type=int, default=2048, help="default: the CLI's")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="pdserve-rss-"))
    stack = start_stack(args.model, logs, engine_args=["--page-size", str(args.page_size), "--num-pages",
                                                       str(args.num_pages)])
    try:
        procs = {"prefill": stack.prefill[0], "decode": stack.decode[0], "router": stack.router}
        print(f"KV pool: prefill {pool_mb(stack.prefill[0].address, pb_grpc.PrefillWorkerStub):.0f} MB, decode "
              f"{pool_mb(stack.decode[0].address, pb_grpc.DecodeWorkerStub):.0f} MB (logs in {logs})")
        rng = random.Random(0)
        channel = grpc.insecure_channel(stack.router.address)
        stub = gen_grpc.GenerationStub(channel)

        def one(_: int) -> bool:
            ids = [rng.randrange(5, 1000) for _ in range(args.prompt_len)]
            req = gen_pb.GenerateRequest(tokenized=gen_pb.TokenizedInput(input_ids=ids), sampling_params=gen_pb.
                                         SamplingParams(max_new_tokens=4, ignore_eos=True))
            try:
                return list(stub.Generate(req, timeout=60))[-1].HasField("complete")
            except grpc.RpcError:
                return False

        print("phase  requests  seconds  " + "  ".join(f"{name}_rss_mb" for name in procs))
        print(f"{0:5d}  {0:8d}  {0:7.1f}  " + "  ".join(f"{rss_mb(p.popen.pid):13.0f}" for p in procs.values()))
        done = 0
        for phase in range(1, args.phases + 1):
            t0 = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                ok = sum(pool.map(one, range(args.requests)))
            done += args.requests
            assert ok == args.requests, f"{args.requests - ok} requests failed"
            print(f"{phase:5d}  {done:8d}  {time.monotonic() - t0:7.1f}  "
                  + "  ".join(f"{rss_mb(p.popen.pid):13.0f}" for p in procs.values()), flush=True)
        channel.close()
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
