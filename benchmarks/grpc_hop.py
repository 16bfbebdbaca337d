"""How long one gRPC message takes from one process to another on this host, after the idle gaps a request sees.

At concurrency 1 a prompt's first token crosses four process hops in a row (client -> router -> prefill worker ->
router -> client), most of them into a process that sat idle for a whole decode. What
one such hop costs on a machine bounds the TTFT the stack can reach against the engine's prefill, whatever the stack's
own code does. This measures bare grpc.aio (no pdserve code), two processes on 127.0.0.1:

  unary    a unary call carrying --payload-bytes (a 2048-token PrefillRequest is ~8 KB), as the router's Prefill
  stream   the same bytes as one message on a bidirectional stream opened once (what a persistent router <-> worker
           stream would pay)

For each --gaps value (seconds the client sleeps before each message), --calls messages: the median one-way time (the
server stamps its receipt with CLOCK_MONOTONIC, one clock for the host's processes) and round trip.

--keep-warm-ms X: meanwhile the client sends a 1-byte message every X ms on another stream of the same channel, which
the server reads and never answers (what a router could send on an idle prefill worker's open call): whether the idle
gaps' extra cost goes with it.

    python benchmarks/grpc_hop.py [--gaps 0.002 0.04 0.11] [--calls 60] [--keep-warm-ms 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import grpc

UNARY, STREAM, SINK = "/pdserve.bench.Hop/Unary", "/pdserve.bench.Hop/Stream", "/pdserve.bench.Hop/Sink"
WARMUP_CALLS = 5


def _stamp() -> bytes:
    return struct.pack("<d", time.monotonic())


async def _serve(port_file: str) -> None:
    async def unary(request: bytes, context) -> bytes:
        return _stamp()

    async def stream(requests, context):
        async for _ in requests:
            yield _stamp()

    async def sink(requests, context) -> bytes:
        async for _ in requests:
            pass
        return b""

    handler = grpc.method_handlers_generic_handler("pdserve.bench.Hop", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
        "Sink": grpc.stream_unary_rpc_method_handler(sink)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(port_file + ".tmp", port_file)  # the client never reads a half-written port
    await server.wait_for_termination()


async def _keep_warm(channel, every_s: float) -> None:
    sink = channel.stream_unary(SINK)()
    try:
        while True:
            await asyncio.sleep(every_s)
            await sink.write(b"w")
    finally:
        sink.cancel()


async def _measure(port: int, gap_s: float, calls: int, payload: bytes, keep_warm_s: float = 0.0) -> dict:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(UNARY)
        call = channel.stream_stream(STREAM)()
        warm = asyncio.ensure_future(_keep_warm(channel, keep_warm_s)) if keep_warm_s > 0 else None
        rows = {"unary": ([], []), "stream": ([], [])}
        for i in range(WARMUP_CALLS + calls):
            for kind in ("unary", "stream"):  # alternating, so that both see the same moments of the machine
                await asyncio.sleep(gap_s)
                t0 = time.monotonic()
                if kind == "unary":
                    reply = await unary(payload)
                else:
                    await call.write(payload)
                    reply = await call.read()
                t1 = time.monotonic()
                if i >= WARMUP_CALLS:
                    rows[kind][0].append(struct.unpack("<d", reply)[0] - t0)
                    rows[kind][1].append(t1 - t0)
        if warm is not None:
            warm.cancel()
            await asyncio.gather(warm, return_exceptions=True)
        await call.done_writing()
    return {kind: {"one_way_ms": round(1e3 * statistics.median(one), 4),
                   "round_trip_ms": round(1e3 * statistics.median(rtt), 4)}
            for kind, (one, rtt) in rows.items()}


def measure(gaps_s: list[float], calls: int, payload_bytes: int, keep_warm_ms: float = 0.0) -> list[dict]:
    """[{"gap_ms", "unary": {"one_way_ms", "round_trip_ms"}, "stream": {...}}] with a server process of its own;
    keep_warm_ms > 0: with the keep-warm stream beside them (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", port_file])
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(port_file):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the hop server did not start")
                time.sleep(0.02)
            with open(port_file) as f:
                port = int(f.read())
            payload = bytes(payload_bytes)
            return [{"gap_ms": 1e3 * gap, **asyncio.run(_measure(port, gap, calls, payload, keep_warm_ms / 1e3))}
                    for gap in gaps_s]
        finally:
            server.kill()
            server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gaps", type=float, nargs="+", default=[0.002, 0.04, 0.11], help="idle seconds before a message")
    p.add_argument("--calls", type=int, default=60, help="messages per gap and kind (after 5 not counted)")
    p.add_argument("--payload-bytes", type=int, default=8192)
    p.add_argument("--keep-warm-ms", type=float, default=0.0, metavar="MS",
                   help="a 1-byte message every MS on another stream meanwhile, never answered (default 0: none)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return
    if args.calls < 1 or any(g < 0 for g in args.gaps) or args.keep_warm_ms < 0:
        p.error("--calls must be at least 1, --gaps and --keep-warm-ms not negative")
    rows = measure(args.gaps, args.calls, args.payload_bytes, args.keep_warm_ms)
    warm = f", kept warm every {args.keep_warm_ms:g} ms" if args.keep_warm_ms else ""
    print(f"bare grpc.aio {grpc.__version__}, {args.payload_bytes} bytes, {args.calls} messages per row "
          f"(median ms){warm}")
    print(f"{'idle gap':>10s} | {'unary one way':>13s} {'round trip':>10s} | {'stream one way':>14s} {'round trip':>10s}")
    for r in rows:
        print(f"{r['gap_ms']:7.0f} ms | {r['unary']['one_way_ms']:13.3f} {r['unary']['round_trip_ms']:10.3f} | "
              f"{r['stream']['one_way_ms']:14.3f} {r['stream']['round_trip_ms']:10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"grpc": grpc.__version__, "payload_bytes": args.payload_bytes, "calls": args.calls,
                       "keep_warm_ms": args.keep_warm_ms, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
