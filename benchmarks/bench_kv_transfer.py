"""KV transfer between two GPUs of one host: pdserve's "nccl", "cuda_ipc" or "nixl" transport against a peer copy of
the same bytes and (nccl) a plain torch.distributed NCCL send/recv of them, measured in the same run, plus the GPU
memory an NCCL communicator takes.

Layout: DeepSeek-V3's latent KV, --layers 61 x --kv-dim 576 bf16 values per token (70.3 KiB a token), rooms of
--tokens 4096 and 16384 (288 MiB and 1.15 GiB). This process is the prefill side (rows on --prefill-device); it
starts the decode side (a pool on --decode-device) as a child process of this script.

- ours: begin() (5 ms ahead, as the stack opens a room while its prompt computes), then timed: the rows (--send room: every layer in one send_layers, as a prefill worker hands over a whole
  prompt; layers: one send_layer per layer, as it streams) -> finish() -> wait() for the decode worker's
  confirmation, the rows scattered into the pool's pages; with --page-order contiguous (one run of pages) and
  shuffled (the reserved pages in random order, the worst case of a fragmented pool).
- peer copy (two GPUs): the same bytes as one contiguous copy GPU to GPU, the link's ceiling.
- plain: the same bytes, one dist.send/dist.recv per layer into a contiguous buffer over a process group made by
  init_process_group; the floor our per-run ops and control messages are compared with.
- memory: torch.cuda.mem_get_info before and after each communicator is created (NCCL allocates outside torch's
  caching allocator, so memory_allocated() would not see it), on both GPUs; NCCL_* settings are recorded with it.

Every time is the median of --iters runs after --warmup. Not a test: it prints numbers and writes --out.

--backend cuda_ipc (one GPU: both sides on --prefill-device; the decode child's pool mapped into this process over
CUDA IPC, rows copied into its pages): for each --layer-sets size (5 = the V3 slice's 4 layers + NextN; 61 = full
DeepSeek-V3, dummy rows) and --tokens, ours (begin() to the decode worker's confirmation, the control round trips
included) against a plain device copy of the same bytes in this process (`dst.copy_(src)`, the bandwidth ceiling)
and the same scatter by slot without any transport (`pool[layer].index_copy_`), all measured in this run; plus the
one-off pairing (connect, handshake, mapping) and, with --compare-tcp, the tcp transport on the V3-slice sizes.
"page scatter" is the transport's own data path without the transport: the sender's `scatter_pages` (whole pages
in one kernel, a partial last page by itself, one copy when the pages are one run) on every layer, the device time
of what the writer thread queues; "ours (device) / copy" compares it with the device copy.

    python benchmarks/bench_kv_transfer.py --backend cuda_ipc --prefill-device cuda:0 --tokens 2048 16384 \
        --out /tmp/kv_ipc.json --compare-tcp      # bash benchmarks/gpu.sh kv-ipc

    python benchmarks/bench_kv_transfer.py --out /tmp/kv_transfer.json    # bash benchmarks/gpu.sh kv, on two GPUs
    python benchmarks/bench_kv_transfer.py --backend cuda_ipc --decode-device cuda:1 --out /tmp/kv_ipc2.json  # (kv)
    python benchmarks/bench_kv_transfer.py --backend gloo --prefill-device cpu --decode-device cpu --layers 4 \\
        --tokens 256 --iters 2 --out /tmp/kv_transfer_cpu.json    # a dry run of the script on the CPU (Gloo)
    python benchmarks/bench_kv_transfer.py --backend nixl --out /tmp/kv_nixl.json    # NIXL WRITEs GPU 0 -> GPU 1
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.kv_transfer import TRANSPORTS, KVLayout, token_slots  # noqa: E402
from pdserve.kv_transfer import pages  # noqa: E402
from pdserve.kv_transfer.pages import plan_pages, scatter_pages  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write (every number of the run)")
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo", "cuda_ipc", "tcp", "nixl"],
                   help="transport to measure (default nccl)")
    p.add_argument("--layer-sets", type=int, nargs="+", default=[5, 61],
                   help="cuda_ipc: KV layer counts measured (5: the V3 slice, 4 layers + NextN; 61: DeepSeek-V3)")
    p.add_argument("--compare-tcp", action="store_true", help="cuda_ipc: also the tcp transport, V3-slice sizes")
    p.add_argument("--prefill-device", default="cuda:0")
    p.add_argument("--decode-device", default="cuda:1")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="room sizes in tokens")
    p.add_argument("--layers", type=int, default=61, help="KV layers (DeepSeek-V3: 61)")
    p.add_argument("--kv-dim", type=int, default=576, help="latent values per token and layer (V3: 512 + 64)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--page-order", nargs="+", default=["contiguous", "shuffled"], choices=["contiguous", "shuffled"])
    p.add_argument("--send", nargs="+", default=["room", "layers"], choices=["room", "layers"],
                   help="room: every layer in one send_layers (as the prefill worker hands over a whole prompt); "
                        "layers: one send_layer per layer (as it streams layer by layer)")
    p.add_argument("--max-chunks", type=int, nargs="+", default=[pages.MAX_CHUNKS],
                   help="two GPUs: the senders' cap on the runs of layers a send is cut into (pages.MAX_CHUNKS; 1: "
                        "every send crosses whole); each value measures every case again (default: pdserve's)")
    p.add_argument("--paired", action="store_true",
                   help="cuda_ipc/tcp with both sides on one GPU: the two-GPU table's pair of processes (whole rooms "
                        "timed against a copy of the same bytes) instead of the per-layer-set one; on one GPU the "
                        "copy is nearly free, so what a room costs beyond it shows")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler's busiest device operations of each case's measured rooms")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--role", default="prefill", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    p.add_argument("--kv-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--plain-port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_bytes(device: torch.device) -> int:
    """Free device memory, after torch's cache gave back what it holds unused (so only real allocations count)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layout_of(args) -> KVLayout:
    return KVLayout("bench-kv-transfer", args.page_size, args.layers, args.kv_dim, args.dtype)


def room_bytes(args, tokens: int) -> int:
    return args.layers * tokens * args.kv_dim * layout_of(args).torch_dtype.itemsize


def num_pages(args) -> int:
    return -(-max(args.tokens) // args.page_size)


def plain_group(args, rank: int, device: torch.device) -> int:
    """init_process_group over --plain-port, one warm-up exchange; the device memory it took."""
    import torch.distributed as dist

    before = free_bytes(device)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.plain_port}", rank=rank, world_size=2)
    probe = torch.ones(1, device=device)
    (dist.send if rank == 1 else dist.recv)(probe, 1 - rank)
    return before - free_bytes(device)


# ---- decode side: a child process, driven over stdin -------------------------------------------------------------
def decode_main(args) -> None:
    device = torch.device(args.decode_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layout = layout_of(args)
    pool = torch.zeros(args.layers, (num_pages(args) + 1) * args.page_size, args.kv_dim, dtype=layout.torch_dtype,
                       device=device)
    say = lambda *words: print(*words, flush=True)  # noqa: E731
    before = free_bytes(device)
    # nixl: a staging area that holds the largest room, so shuffled pages are staged at every size measured
    options = {"staging_bytes": room_bytes(args, max(args.tokens))} if args.backend == "nixl" else {}
    receiver = TRANSPORTS.get(args.backend).receiver(
        layout, port=args.kv_port, kv_buffer=pool, timeout_s=600, on_layer=lambda *a: None,
        on_done=lambda room, aux: None, on_failed=lambda room, e: say("failed", room, e), **options)
    say("ready", receiver.endpoint)
    buffer = torch.empty(max(args.tokens), args.kv_dim, dtype=layout.torch_dtype, device=device)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "expect":
            receiver.expect(int(cmd[1]), int(cmd[2]), json.loads(cmd[3]), int(cmd[4]) if len(cmd) > 4 else args.layers)
        elif cmd[0] == "plain":  # receive --layers layers of n tokens, once per iteration
            import torch.distributed as dist

            n, iters = int(cmd[1]), int(cmd[2])
            for _ in range(iters):
                for _ in range(args.layers):
                    dist.recv(buffer[:n], 1)  # from the prefill side (rank 1, as in pdserve)
                sync(device)
        elif cmd[0] == "plain-init":
            say("plain-bytes", plain_group(args, 0, device))
            continue
        elif cmd[0] == "stats":
            pairs = [c.link.comm_bytes for c in list(receiver._conns) if getattr(c.link, "comm_bytes", None) is not None]
            say("stats", json.dumps({"pair_comm_bytes": pairs, "mem_get_info_bytes": before - free_bytes(device)}))
            continue
        elif cmd[0] == "poison":
            pool.fill_(float("nan"))
            sync(device)
        elif cmd[0] == "digest":  # the rows of `tokens` tokens in `pages`, as they sit in the pool
            slots = token_slots(json.loads(cmd[2]), int(cmd[1]), args.page_size, device=device)
            say("digest", digest(pool[:int(cmd[3]), slots]))
            continue
        elif cmd[0] == "quit":
            break
        say("ok", cmd[0])
    receiver.close()


# ---- prefill side: this process ----------------------------------------------------------------------------------
class Child:
    def __init__(self, args):
        argv = [sys.executable, os.path.abspath(__file__), "--role", "decode", "--out", "-", "--backend",
                args.backend, "--decode-device", args.decode_device, "--layers", str(args.layers), "--kv-dim",
                str(args.kv_dim), "--dtype", args.dtype, "--page-size", str(args.page_size), "--kv-port", "0",
                "--plain-port", str(args.plain_port), "--tokens", *map(str, args.tokens)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.backend = args.backend
        self.endpoint = self.expect_line("ready").split()[1]

    def expect_line(self, prefix: str) -> str:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the decode process ended (status {self.proc.poll()}) before {prefix!r}")
            if line.startswith(prefix):
                return line.strip()
            print(f"[decode] {line.rstrip()}", file=sys.stderr)

    def send(self, line: str, answer: str | None = "ok") -> str | None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.expect_line(answer) if answer else None


def run_ours(args, child: Child, sender, rows: torch.Tensor, tokens: int, order: str, first_room: int,
             layers: int | None = None, send: str = "layers") -> dict:
    need = -(-tokens // args.page_size)
    pages = list(range(need))
    if order == "shuffled":
        random.Random(tokens).shuffle(pages)
    aux = {"first_token_id": 0, "cached_tokens": 0, "hidden": None, "rng_state": b""}
    times = []
    for i in range(args.warmup + args.iters):
        room = first_room + i
        layers = layers or args.layers
        child.send(f"expect {room} {tokens} {json.dumps(pages, separators=(',', ':'))} {layers}")
        # The room is opened before the rows are ready, as a prefill worker opens it while the prompt computes
        # (the decode worker's grant arrives meanwhile); timed from the rows' hand-over to the confirmation.
        h = sender.begin(child.endpoint, room, layers, dst_pages=pages)
        time.sleep(OPEN_AHEAD_S)
        sync(rows.device)
        t0 = time.perf_counter()
        if send == "room":
            h.send_layers(0, rows[:layers, :tokens])
        else:
            for layer in range(layers):
                h.send_layer(layer, rows[layer, :tokens])
        h.finish(aux)
        h.wait(timeout=600)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        if i == args.warmup + args.iters - 2:  # the last room lands in a poisoned pool, then is compared
            child.send("poison")
    # The last room's rows, read back from the decode pool's pages, bit for bit (digests of both sides)
    got = int(child.send(f"digest {tokens} {json.dumps(pages, separators=(',', ':'))} {layers}",
                         answer="digest").split()[1])
    identical = got == digest(rows[:layers, :tokens])
    if not identical:
        print(f"ROWS DIFFER: the last room of {tokens} tokens ({order}, send={send}) did not land bit-identical",
              flush=True)
    return {"seconds": statistics.median(times), "send": send, "all_seconds": times, "bit_identical": identical}


def digest(rows: torch.Tensor) -> int:
    """An integer digest of rows `(layers, tokens, kv_dim)`, equal for bit-identical rows (and, in practice, only
    for them): each value's bits weighted by its position, summed exactly in int64 on the rows' device."""
    total = 0
    for i, layer in enumerate(rows):  # (tokens, kv_dim): a layer at a time bounds the temporaries
        bits = layer.contiguous().view(torch.int16).flatten().to(torch.int64)
        first = i * bits.numel() + 1
        weights = torch.arange(first, first + bits.numel(), device=bits.device) % 65521 + 1
        total += int((bits * weights).sum())
    return total


def run_peer_copy(args, rows: torch.Tensor, tokens: int, dst_device: torch.device) -> dict:
    """The same bytes as one contiguous copy from the rows' GPU into a buffer on `dst_device`: the link's ceiling."""
    src = rows[:, :tokens].contiguous()  # (layers, tokens, kv_dim)
    dst = torch.empty_like(src, device=dst_device)
    times = []
    for i in range(args.warmup + args.iters):
        sync(src.device), sync(dst_device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(src.device), sync(dst_device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "all_seconds": times}


OPEN_AHEAD_S = 0.005  # how long before the hand-over a room is opened (a V3 prompt's forward takes longer)


def run_plain(args, child: Child, rows: torch.Tensor, tokens: int) -> dict:
    import torch.distributed as dist

    child.send(f"plain {tokens} {args.warmup + args.iters}", answer=None)
    times = []
    for i in range(args.warmup + args.iters):
        sync(rows.device)
        t0 = time.perf_counter()
        for layer in range(args.layers):
            dist.send(rows[layer, :tokens], 0)
        sync(rows.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    child.expect_line("ok plain")
    return {"seconds": statistics.median(times), "all_seconds": times}


def prefill_main(args) -> None:
    device = torch.device(args.prefill_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # as pdserve's nccl workers run
    args.plain_port = free_port()
    layout = layout_of(args)
    rows = torch.randn(args.layers, max(args.tokens), args.kv_dim, device=device).to(layout.torch_dtype)
    child = Child(args)
    result = {"command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
              "backend": args.backend, "prefill_device": args.prefill_device, "decode_device": args.decode_device,
              "layout": layout.to_dict(), "bytes_per_token": args.layers * args.kv_dim * layout.torch_dtype.itemsize,
              "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))},
              "cases": []}
    if device.type == "cuda":
        result["gpus"] = [torch.cuda.get_device_name(d) for d in (args.prefill_device, args.decode_device)]
        result["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        before = free_bytes(device)
        # nixl: a send arena that holds the largest room, as the decode side's staging does
        options = {"arena_bytes": room_bytes(args, max(args.tokens))} if args.backend == "nixl" else {}
        sender = TRANSPORTS.get(args.backend).sender(layout, device=device, timeout_s=600, **options)
        # The first room builds the pair (its communicator): one token, so nothing else shows in the memory delta.
        connect = {**vars(args), "tokens": [1], "warmup": 0, "iters": 1}
        run_ours(argparse.Namespace(**connect), child, sender, rows, 1, "contiguous", 1)
        conn = next(iter(sender._conns.values()))
        result["transport"] = conn.transport  # what the pairing chose (auto / cuda_ipc: cuda_ipc or tcp)
        result["link"] = getattr(conn.plane, "ucx", None)  # nixl: the UCX transports it picked for the WRITEs
        stats = json.loads(child.send("stats", answer="stats").split(maxsplit=1)[1])
        result["memory"] = {"prefill_ours_mem_get_info_bytes": before - free_bytes(device),
                            "prefill_ours_pair_bytes": getattr(getattr(conn.plane, "pair", None), "comm_bytes", 0),
                            "decode_ours_pair_bytes": stats["pair_comm_bytes"],
                            "decode_ours_mem_get_info_bytes": stats["mem_get_info_bytes"]}
        decode_device = torch.device(args.decode_device)
        peer = {}
        if device.type == "cuda" and decode_device != device:
            for tokens in args.tokens:
                peer[tokens] = run_peer_copy(args, rows, tokens, decode_device)
                peer[tokens]["GB_per_s"] = tokens * result["bytes_per_token"] / peer[tokens]["seconds"] / 1e9
                print(f"peer copy {device} -> {decode_device} {tokens:6d} tokens {peer[tokens]['seconds'] * 1e3:8.2f} "
                      f"ms {peer[tokens]['GB_per_s']:7.2f} GB/s", flush=True)
        room = 2
        for send, max_chunks, order, tokens in itertools.product(args.send, args.max_chunks, args.page_order,
                                                                 args.tokens):
            pages.MAX_CHUNKS = max_chunks  # read by the senders at each send (only they cut a room)
            case = {"tokens": tokens, "page_order": order, "send": send, "max_chunks": max_chunks,
                    "bytes": tokens * result["bytes_per_token"]}
            profiler = None
            if args.profile:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                              torch.profiler.ProfilerActivity.CUDA])
                profiler.__enter__()
            case["ours"] = run_ours(args, child, sender, rows, tokens, order, room, send=send)
            if profiler is not None:
                profiler.__exit__(None, None, None)
                print(profiler.key_averages().table(sort_by="device_time_total", row_limit=14), flush=True)
            room += args.warmup + args.iters
            case["ours"]["GB_per_s"] = case["bytes"] / case["ours"]["seconds"] / 1e9
            if tokens in peer:
                case["peer_copy"] = peer[tokens]
                case["ours_over_peer_copy"] = case["ours"]["GB_per_s"] / peer[tokens]["GB_per_s"]
            result["cases"].append(case)
            print(f"ours {args.backend} ({result['link'] or result['transport']}) send={send:6s} "
                  f"chunks<={max_chunks} {order:10s} {tokens:6d} tokens "
                  f"{case['bytes'] / 2**20:8.1f} MiB {case['ours']['seconds'] * 1e3:8.2f} ms "
                  f"{case['ours']['GB_per_s']:7.2f} GB/s"
                  + (f" = {case['ours_over_peer_copy']:.2f} of a peer copy" if tokens in peer else "")
                  + ("" if case["ours"]["bit_identical"] else " ROWS DIFFER"), flush=True)
        if args.backend in ("nccl", "gloo"):  # the same bytes over a plain torch.distributed group
            child.send("plain-init", answer=None)
            result["memory"]["prefill_plain_bytes"] = plain_group(args, 1, device)
            result["memory"]["decode_plain_bytes"] = int(child.expect_line("plain-bytes").split()[1])
            for tokens in args.tokens:
                plain = run_plain(args, child, rows, tokens)
                plain["GB_per_s"] = tokens * result["bytes_per_token"] / plain["seconds"] / 1e9
                print(f"plain {'':10s} {tokens:6d} tokens {plain['seconds'] * 1e3:28.2f} ms "
                      f"{plain['GB_per_s']:7.2f} GB/s", flush=True)
                for c in result["cases"]:
                    if c["tokens"] == tokens:
                        c["plain"] = plain
                        c["ours_over_plain"] = c["ours"]["GB_per_s"] / plain["GB_per_s"]
            mem = result["memory"]
            print(f"communicator memory, prefill / decode GPU: ours {mem['prefill_ours_mem_get_info_bytes'] / 2**20:.1f}"
                  f" / {mem['decode_ours_mem_get_info_bytes'] / 2**20:.1f} MiB (measured inside the pair: "
                  f"{mem['prefill_ours_pair_bytes'] / 2**20:.1f} / {[b / 2**20 for b in mem['decode_ours_pair_bytes']]}"
                  f" MiB); plain {mem['prefill_plain_bytes'] / 2**20:.1f} / {mem['decode_plain_bytes'] / 2**20:.1f} MiB")
        child.send("quit", answer=None)
        sender.close()
    finally:
        child.proc.stdin.close()
        child.proc.wait(timeout=60)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


def device_times(fn, warmup: int, iters: int) -> float:
    """Median seconds of fn() on the current stream, timed with CUDA events (perf_counter on the CPU)."""
    times = []
    for i in range(warmup + iters):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_ceilings(args, case: dict, rows: torch.Tensor, device: torch.device) -> None:
    """Add to `case` (and print) the device copy, the scatter by slot and the page scatter of its bytes; the
    buffers go when this returns, before the next case allocates its own."""
    layers, tokens = case["layers"], case["tokens"]
    src = rows[:layers, :tokens].contiguous()  # (layers, tokens, kv_dim)
    dst = torch.empty_like(src)
    copy_s = device_times(lambda: dst.copy_(src), args.warmup, args.iters)
    pool = torch.empty(layers, (num_pages(args) + 1) * args.page_size, args.kv_dim, dtype=src.dtype, device=device)
    pages = list(range(-(-tokens // args.page_size)))
    if case["page_order"] == "shuffled":
        random.Random(tokens).shuffle(pages)  # the pages run_ours sent to
    slots = token_slots(pages, tokens, args.page_size, device=device)

    def scatter():
        for layer in range(layers):
            pool[layer].index_copy_(0, slots, src[layer])

    scatter_s = device_times(scatter, args.warmup, args.iters)
    plan = plan_pages(pages, tokens, args.page_size, device)  # once per room, as the sender makes it

    def page_scatter():  # exactly what the cuda_ipc sender queues for each layer
        for layer in range(layers):
            scatter_pages(pool[layer], src[layer], plan)

    page_s = device_times(page_scatter, args.warmup, args.iters)
    case["device_copy"] = {"seconds": copy_s, "GB_per_s": case["bytes"] / copy_s / 1e9}
    case["scatter_only"] = {"seconds": scatter_s, "GB_per_s": case["bytes"] / scatter_s / 1e9}
    case["page_scatter"] = {"seconds": page_s, "GB_per_s": case["bytes"] / page_s / 1e9,
                            "ops_per_layer": len(plan.runs) if plan.full_pages is None else 1 + (plan.tail is not None)}
    case["ours_over_device_copy"] = case["ours"]["GB_per_s"] / case["device_copy"]["GB_per_s"]
    case["page_scatter_over_device_copy"] = case["page_scatter"]["GB_per_s"] / case["device_copy"]["GB_per_s"]
    print(f"{case['backend']:8s} {layers:3d} layers {tokens:6d} tokens {case['page_order']:10s} "
          f"{case['bytes'] / 2**20:8.1f} MiB: ours {case['ours']['seconds'] * 1e3:8.3f} ms "
          f"{case['ours']['GB_per_s']:7.1f} GB/s | device copy {copy_s * 1e3:7.3f} ms "
          f"{case['device_copy']['GB_per_s']:7.1f} GB/s | scatter alone {scatter_s * 1e3:7.3f} ms | "
          f"page scatter {page_s * 1e3:7.3f} ms {case['page_scatter']['GB_per_s']:7.1f} GB/s | "
          f"ours / copy {case['ours_over_device_copy']:.2f} | "
          f"ours (device) / copy {case['page_scatter_over_device_copy']:.2f}", flush=True)


def same_gpu_main(args) -> None:
    """--backend cuda_ipc (and tcp): both sides on one GPU; see the module docstring."""
    device = torch.device(args.prefill_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    args.decode_device, args.layers = args.prefill_device, max(args.layer_sets)
    layout = layout_of(args)
    rows = torch.randn(args.layers, max(args.tokens), args.kv_dim, device=device).to(layout.torch_dtype)
    result = {"command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "backend": args.backend, "device": args.prefill_device,
              "layout": layout.to_dict(), "page_size": args.page_size, "cases": []}
    backends = [args.backend] + (["tcp"] if args.compare_tcp and args.backend != "tcp" else [])
    room = 1
    for backend in backends:
        child = Child(argparse.Namespace(**{**vars(args), "backend": backend}))
        try:
            before = free_bytes(device)
            sender = TRANSPORTS.get(backend).sender(layout, device=device, timeout_s=600)
            t0 = time.perf_counter()
            run_ours(argparse.Namespace(**{**vars(args), "warmup": 0, "iters": 1}), child, sender, rows, 1,
                     "contiguous", room, layers=1)
            room += 1
            pairing = {"backend": backend, "first_room_seconds": time.perf_counter() - t0,
                       "mem_get_info_bytes": before - free_bytes(device),
                       "transport": next(iter(sender._conns.values())).transport}
            result.setdefault("pairing", []).append(pairing)
            print(f"{backend}: pairing (connect, handshake, map) + a 1-token room "
                  f"{pairing['first_room_seconds'] * 1e3:.1f} ms, over {pairing['transport']}; device memory {pairing['mem_get_info_bytes'] / 2**20:.1f} MiB",
                  flush=True)
            for layers in args.layer_sets:
                if backend == "tcp" and layers != min(args.layer_sets):
                    continue  # through the host: the V3-slice sizes say enough
                for order in args.page_order:
                    for tokens in args.tokens:
                        nbytes = layers * tokens * args.kv_dim * layout.torch_dtype.itemsize
                        case = {"backend": backend, "layers": layers, "tokens": tokens, "page_order": order,
                                "bytes": nbytes}
                        case["ours"] = run_ours(args, child, sender, rows, tokens, order, room, layers=layers)
                        room += args.warmup + args.iters
                        case["ours"]["GB_per_s"] = nbytes / case["ours"]["seconds"] / 1e9
                        result["cases"].append(case)
            sender.close()
            child.send("quit", answer=None)
        finally:
            child.proc.stdin.close()
            child.proc.wait(timeout=60)
    for case in result["cases"]:  # the ceilings, in this process on the same GPU, same bytes
        measure_ceilings(args, case, rows, device)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.role == "decode":
        decode_main(args)
    elif args.backend in ("cuda_ipc", "tcp") and args.decode_device == args.prefill_device and not args.paired:
        same_gpu_main(args)
    else:
        prefill_main(args)


if __name__ == "__main__":
    main()
