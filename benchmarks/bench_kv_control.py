"""The KV transports' fixed cost per room, on the CPU: tiny rooms sent one after another from this process (the
prefill side) to a decode receiver in a child process, so what is timed is the control path (handshake excluded:
BEGIN/GRANT, LAYER announcements or frames, AUX, ROOM_DONE, and the threads that hand them on), not the bytes.

Per room: the decode child expected it (every room up front), then this process times begin() (or, with
--open-ahead-ms, the rows' hand-over after begin() and a pause, as the stack opens a room ahead) -> the rows (--send
room: every layer in one send_layers, as a prefill worker hands over a whole prompt; layers: one send_layer per
layer) -> finish() -> wait() for the decode worker's confirmation. "cuda_ipc" runs its real protocol over a CPU
stand-in of the mapping (the decode pool in a shared-memory file that the sender maps), as tests/test_kv_transfer_ipc.py
does in one process. Prints, per room, the median, mean and p90 time and the CPU time each process spent (all its
threads: on a machine shared with other work the steadier number), and writes --out (JSON) when given. Not a test.
Before/after a change: run it in a checkout of each commit, alternating, several times.

    python benchmarks/bench_kv_control.py                                   # tcp, gloo, cuda_ipc; 1000 rooms each
    python benchmarks/bench_kv_control.py --transports tcp --rooms 3000 --send layers
    python benchmarks/bench_kv_control.py --transports cuda_ipc --send room --layers 61 --open-ahead-ms 2 --stages
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.kv_transfer import TRANSPORTS, KVLayout, control_receiver, control_sender  # noqa: E402
from pdserve.kv_transfer.control_sender import RoomHandle  # noqa: E402
from pdserve.kv_transfer.cuda_ipc_pairing import Facts, IpcBackend  # noqa: E402

AUX = {"first_token_id": 1, "cached_tokens": 0, "hidden": None, "rng_state": b""}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", nargs="+", default=["tcp", "gloo", "cuda_ipc"], choices=["tcp", "gloo", "cuda_ipc"])
    p.add_argument("--send", nargs="+", default=["room", "layers"], choices=["room", "layers"])
    p.add_argument("--rooms", type=int, default=1000, help="rooms timed per case (after --warmup more)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--tokens", type=int, default=16, help="tokens per room (tiny: the bytes cost next to nothing)")
    p.add_argument("--layers", type=int, default=5, help="KV layers per room (5: the V3 slice, 4 layers + NextN)")
    p.add_argument("--kv-dim", type=int, default=576)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--open-ahead-ms", type=float, default=0.0,
                   help="open each room (begin) this long before its rows, as the stack opens a room while its prompt "
                        "computes, and time from the rows' hand-over; 0: begin() is timed too (its BEGIN/GRANT)")
    p.add_argument("--stages", action="store_true",
                   help="also print where a room's time goes: the median time, from the rows' hand-over, at which "
                        "each process's write of a frame returned or its read of one did, and of the caller's calls "
                        "(both processes read CLOCK_MONOTONIC); the wrappers that record them cost time of their own")
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--role", default="prefill", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    p.add_argument("--transport", default="tcp", help=argparse.SUPPRESS)
    p.add_argument("--pool-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--stages-file", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class SharedFileIpc(IpcBackend):
    """cuda_ipc's GPU calls on the CPU: the decode pool lives in a shared-memory file; "exporting" it names the file
    and "mapping" it opens the file in the sender's process, so the sender's writes land in the decode pool."""

    def __init__(self, path: str = ""):
        self.path = path  # the decode side's pool file

    def local_facts(self, device) -> Facts:
        return Facts("bench-host", "GPU-bench", ("GPU-bench",))

    def export_problem(self, kv):
        return None

    def export(self, kv):
        return {"gpu": "GPU-bench", "handle": base64.b64encode(self.path.encode()).decode(),
                "storage_bytes": kv.numel() * kv.element_size(), "storage_offset": 0,
                "counter": base64.b64encode(b"/torch_bench_0").decode(), "counter_offset": 0,
                "event": base64.b64encode(bytes(64)).decode(), "event_sync": False, "shape": list(kv.shape),
                "dtype": str(kv.dtype).removeprefix("torch.")}

    def open(self, fields, dtype):
        path = base64.b64decode(fields["handle"]).decode()
        return shared_pool(path, tuple(fields["shape"]), dtype)


def shared_pool(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = shape[0] * shape[1] * shape[2]
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


class Stages:
    """--stages: the time (time.perf_counter, CLOCK_MONOTONIC: one clock for both processes) of every frame this process
    writes or reads on the control channel, and of the prefill caller's calls, recorded by wrapping the control
    modules' frame functions and the room handle's calls in this process (a benchmark's instrumentation, not a
    worker's)."""

    _THREADS = (("kv-send-w", "writer"), ("kv-send-r", "reader"), ("kv-recv-notify", "notifier"),
                ("kv-recv-timer", "timer"), ("kv-recv", "connection"), ("MainThread", "caller"))
    _KIND = re.compile(rb'"kind":"(\w+)"')

    def __init__(self, side: str):
        self.side, self.events, self._originals = side, [], []
        for module in (control_sender, control_receiver):
            for name in ("write_frame", "send_frame", "recv_frame"):
                if hasattr(module, name):
                    self._wrap(module, name, self._frames(getattr(module, name), name))
        for name, what in (("_send", "hands over rows"), ("finish", "finish()"), ("wait", "wait() returns")):
            self._wrap(RoomHandle, name, self._call(getattr(RoomHandle, name), what, after=name == "wait"))

    def _wrap(self, owner, name: str, wrapper) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)

    def note(self, what: str) -> None:
        thread = threading.current_thread().name
        who = next((short for prefix, short in self._THREADS if thread.startswith(prefix)), thread)
        self.events.append((time.perf_counter(), f"{self.side} {who}: {what}"))

    def _frames(self, fn, name: str):
        def wrapped(sock, *a, **k):
            out = fn(sock, *a, **k)
            if name == "recv_frame":
                if out is not None:
                    self.note(f"reads {out[0].get('kind')}")
            else:  # write_frame(sock, buffers) or send_frame(sock, header)
                kind = a[0].get("kind") if isinstance(a[0], dict) else self._KIND.search(bytes(a[0][0][:200]))
                self.note(f"writes {kind if isinstance(kind, str) else kind and kind.group(1).decode()}")
            return out
        return wrapped

    def _call(self, fn, what: str, after: bool):
        def wrapped(handle, *a, **k):
            if not after:
                self.note(what)
            out = fn(handle, *a, **k)
            if after:
                self.note(what)
            return out
        return wrapped


def stage_medians(events: list[tuple[float, str]], skip: int) -> list[tuple[float, str]]:
    """Per room (from each first hand-over of rows after the previous room's wait() returned), each event's time
    from the hand-over; the median over the rooms after `skip`, of the events that most rooms have."""
    rooms, current = [], None
    for t, what in sorted(events):
        if what.endswith("hands over rows") and (current is None or current["done"]):
            current = {"t0": t, "seen": collections.Counter(), "done": False, "times": {}}
            rooms.append(current)
        if current is None or current["done"]:
            continue
        current["seen"][what] += 1
        nth = current["seen"][what]
        current["times"][what if nth == 1 else f"{what} #{nth}"] = (t - current["t0"]) * 1e6
        current["done"] = what.endswith("wait() returns")
    rooms = rooms[skip:]
    keys = collections.Counter(key for room in rooms for key in room["times"])
    return sorted((statistics.median(room["times"][key] for room in rooms if key in room["times"]), key)
                  for key, count in keys.items() if count >= 0.8 * len(rooms))


def layout_of(args) -> KVLayout:
    return KVLayout("bench-kv-control", args.page_size, args.layers, args.kv_dim, "bfloat16")


def decode_main(args) -> None:
    stages = Stages("decode") if args.stages_file else None
    layout = layout_of(args)
    pages = -(-args.tokens // args.page_size)
    shape = (args.layers, (pages + 1) * args.page_size, args.kv_dim)
    options = {}
    if args.transport == "cuda_ipc":
        pool = shared_pool(args.pool_file, shape, layout.torch_dtype)
        options["ipc"] = SharedFileIpc(args.pool_file)
    else:
        pool = torch.zeros(shape, dtype=layout.torch_dtype)
    receiver = TRANSPORTS.get(args.transport).receiver(
        layout, kv_buffer=pool, timeout_s=3600, on_layer=lambda *a: None, on_done=lambda room, aux: None,
        on_failed=lambda room, e: print("failed", room, e, flush=True), **options)
    for room in range(1, args.rooms + 1):  # every room up front: nothing but the transfer is timed
        receiver.expect(room, args.tokens, list(range(pages)), args.layers)
    print("ready", receiver.endpoint, flush=True)
    for line in sys.stdin:  # "cpu": this process's CPU seconds so far (every thread's)
        print("cpu", time.process_time(), flush=True)
    receiver.close()
    if stages is not None:
        with open(args.stages_file, "w") as f:
            json.dump(stages.events, f)


def run_case(args, transport: str, send: str) -> dict:
    layout = layout_of(args)
    total = args.warmup + args.rooms
    stages = Stages("prefill") if args.stages else None
    with tempfile.NamedTemporaryFile(prefix="pdserve-bench-kv-control-", dir="/dev/shm") as pool_file, \
            tempfile.NamedTemporaryFile(prefix="pdserve-bench-kv-control-stages-", mode="r") as stages_file:
        argv = [sys.executable, os.path.abspath(__file__), "--role", "decode", "--transport", transport,
                "--rooms", str(total), "--tokens", str(args.tokens), "--layers", str(args.layers), "--kv-dim",
                str(args.kv_dim), "--page-size", str(args.page_size), "--pool-file", pool_file.name]
        if stages is not None:
            argv += ["--stages-file", stages_file.name]
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            line = child.stdout.readline()
            if not line.startswith("ready"):
                raise RuntimeError(f"the decode child did not start: {line!r}")
            endpoint = line.split()[1]

            def child_cpu() -> float:
                child.stdin.write("cpu\n")
                child.stdin.flush()
                return float(child.stdout.readline().split()[1])

            options = {"ipc": SharedFileIpc()} if transport == "cuda_ipc" else {}
            sender = TRANSPORTS.get(transport).sender(layout, timeout_s=60, **options)
            pages = list(range(-(-args.tokens // args.page_size)))
            rows = torch.randn(args.layers, args.tokens, args.kv_dim).to(layout.torch_dtype)
            times = []
            for room in range(1, total + 1):
                if room == args.warmup + 1:
                    cpu0 = time.process_time(), child_cpu()
                t0 = time.perf_counter()
                h = sender.begin(endpoint, room, args.layers, dst_pages=pages)
                if args.open_ahead_ms > 0:
                    time.sleep(args.open_ahead_ms / 1e3)
                    t0 = time.perf_counter()
                if send == "room":
                    h.send_layers(0, rows)
                else:
                    for layer in range(args.layers):
                        h.send_layer(layer, rows[layer])
                h.finish(AUX)
                h.wait()
                if room > args.warmup:
                    times.append(time.perf_counter() - t0)
            cpu = time.process_time() - cpu0[0], child_cpu() - cpu0[1]
            sender.close()
        finally:
            child.stdin.close()
            child.wait(timeout=30)
            if stages is not None:
                stages.uninstall()
        events = stages.events + [tuple(e) for e in json.load(stages_file)] if stages is not None else []
    return {"transport": transport, "send": send, "open_ahead_ms": args.open_ahead_ms, "rooms": len(times),
            "stages_us": stage_medians(events, args.warmup) if events else None, "median_us": statistics.median(times) * 1e6,
            "mean_us": statistics.fmean(times) * 1e6, "p90_us": statistics.quantiles(times, n=10)[-1] * 1e6,
            "prefill_cpu_us": cpu[0] / len(times) * 1e6, "decode_cpu_us": cpu[1] / len(times) * 1e6}


def main() -> None:
    args = parse_args()
    if args.role == "decode":
        return decode_main(args)
    torch.set_num_threads(1)
    result = {"command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]), "torch": torch.__version__,
              "cpus": os.cpu_count(), "cases": []}
    print(f"{'transport':10s} {'send':7s} {'rooms':>6s} {'median us':>10s} {'mean us':>9s} {'p90 us':>8s} "
          f"{'prefill cpu us':>15s} {'decode cpu us':>14s}", flush=True)
    for transport in args.transports:
        for send in args.send:
            case = run_case(args, transport, send)
            result["cases"].append(case)
            print(f"{transport:10s} {send:7s} {case['rooms']:6d} {case['median_us']:10.0f} {case['mean_us']:9.0f} "
                  f"{case['p90_us']:8.0f} {case['prefill_cpu_us']:15.0f} {case['decode_cpu_us']:14.0f}", flush=True)
            for at, what in case["stages_us"] or ():
                print(f"    {at:8.0f} us  {what}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
