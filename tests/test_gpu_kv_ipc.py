"""The "cuda_ipc" and "auto" KV transports on one GPU, each side in its own process (CUDA IPC maps another
process's memory; a process cannot open its own handle): the decode pool lives in this process, a prefill process
maps it and writes the rows. The cases of tests/test_kv_transfer_ipc.py (which runs the protocol on the CPU with
a fake mapping) with the real one, the failures with real processes killed, re-pairing without leaks, and greedy
outputs through the whole stack. Skipped without CUDA.

NOTE: two GPUs of one host (peer access through the same handle) are not exercised here: one GPU is what the
test machine has."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pdserve.kv_transfer import CudaIpcKVSender, KVLayout, KVTransferError, token_slots
from stack import metric, start_pd_on_gpus
from test_kv_transfer_collective import Decode, read_line, wait_until
from golden import check_against_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda:0"
PAGE, LAYERS, KV_DIM, NUM_PAGES = 16, 4, 576, 64  # DeepSeek-V3's latent width, bf16
AUX = {"first_token_id": 7, "cached_tokens": 0, "hidden": None, "rng_state": b""}


def layout() -> KVLayout:
    return KVLayout("tiny-dsv3@ipc", PAGE, LAYERS, KV_DIM, "bfloat16")


def rows_for(room: int, layer: int, num_tokens: int) -> torch.Tensor:
    """The rows prefill sends for (room, layer): reproducible in both processes. (num_tokens, KV_DIM) bf16."""
    gen = torch.Generator().manual_seed(room * 1000 + layer)
    return torch.randn(num_tokens, KV_DIM, generator=gen).to(torch.bfloat16)


# A prefill process driven over stdin, one JSON command a line, answering on stdout.
SENDER_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_gpu_kv_ipc import DEVICE, AUX, layout, rows_for
from pdserve.kv_transfer import TRANSPORTS, KVTransferError
transport = sys.argv[1]
torch.cuda.set_device(DEVICE)
new_sender = lambda: TRANSPORTS.get(transport).sender(layout(), device=DEVICE)
sender, handles = new_sender(), {}
print("ready", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    room = cmd.get("room")
    if cmd["op"] == "begin":
        handles[room] = (sender.begin(cmd["endpoint"], room, layout().num_kv_layers, dst_pages=cmd["pages"]),
                         cmd["tokens"])
    elif cmd["op"] == "layer":
        h, n = handles[room]
        h.send_layer(cmd["layer"], rows_for(room, cmd["layer"], n).to(DEVICE))
    elif cmd["op"] == "finish":
        handles[room][0].finish(AUX)
    elif cmd["op"] == "wait":
        h = handles[room][0]
        try:
            h.wait(timeout=30)
            print("done", room, h.transport, flush=True)
        except KVTransferError as e:
            print("failed", room, e.kind, flush=True)
    elif cmd["op"] == "stall":  # fault: copies on this pairing (its one room) from now on never complete
        h, _ = handles[room]
        h._conn.plane._write = lambda *a: time.sleep(3600)
    elif cmd["op"] == "abort":
        handles[room][0].abort()
    elif cmd["op"] == "repair":  # a new sender: a new connection, a new mapping of the decode pool
        sender.close()
        sender = new_sender()
    elif cmd["op"] == "free":
        torch.cuda.synchronize()
        print("free", torch.cuda.mem_get_info()[0], flush=True)
    print("ok", cmd["op"], room, flush=True)
""".replace("import json, sys, torch", "import json, sys, time, torch")


class Prefill:
    def __init__(self, transport: str = "cuda_ipc"):
        self.proc = subprocess.Popen([sys.executable, "-c", SENDER_SCRIPT, transport], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        read_line(self.proc, "ready", 60.0)

    def do(self, op: str, room: int = 0, **fields) -> None:
        self.ask(op, room, **fields)
        read_line(self.proc, f"ok {op} {room}", 30.0)

    def ask(self, op: str, room: int = 0, **fields) -> None:
        self.proc.stdin.write(json.dumps({"op": op, "room": room, **fields}) + "\n")
        self.proc.stdin.flush()

    def send_room(self, endpoint: str, room: int, pages: list[int], tokens: int, layers=range(LAYERS)) -> None:
        self.do("begin", room, endpoint=endpoint, pages=pages, tokens=tokens)
        for layer in layers:
            self.do("layer", room, layer=layer)

    def outcome(self, room: int) -> str:
        """ "done R TRANSPORT" or "failed R KIND" (printed before "ok wait R")."""
        self.ask("wait", room)
        line = read_line(self.proc, "", 40.0)
        read_line(self.proc, f"ok wait {room}", 5.0)
        return line

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def ipc_decode(cleanup, transport: str = "cuda_ipc", **options) -> Decode:
    """A decode pool on DEVICE with a cuda_ipc/auto receiver (the harness of the CPU tests)."""
    return Decode(cleanup, layout(), transport=transport, device=DEVICE, num_pages=NUM_PAGES, **options)


def landed(decode: Decode, room: int, pages: list[int], tokens: int) -> bool:
    slots = token_slots(pages, tokens, PAGE).to(DEVICE)
    return all(torch.equal(decode.pool.kv[layer, slots].cpu(), rows_for(room, layer, tokens))
               for layer in range(LAYERS))


@pytest.fixture
def prefill():
    p = Prefill()
    yield p
    p.close()


@pytest.mark.parametrize("transport", ["cuda_ipc", "auto"])
def test_rows_land_bit_identical_in_scattered_pages(cleanup, transport):
    decode = ipc_decode(cleanup, transport)
    prefill = Prefill(transport)
    try:
        decode.pool.allocator.alloc(NUM_PAGES)  # the test hands out its own scattered pages
        rooms = {1: ([9, 2, 5, 6, 7, 0, 13, 11], 117), 2: ([20, 21, 22, 23, 24], 65)}  # scattered; one run
        for room, (pages, tokens) in rooms.items():
            decode.reserve(room, tokens, pages)
            prefill.do("begin", room, endpoint=decode.receiver.endpoint, pages=pages, tokens=tokens)
        for layer in range(LAYERS):  # interleaved rooms over one mapping
            for room in rooms:
                prefill.do("layer", room, layer=layer)
        for room in rooms:
            prefill.do("finish", room)
        assert [prefill.outcome(room) for room in rooms] == ["done 1 cuda_ipc", "done 2 cuda_ipc"]
        decode.rec.wait_for(lambda: len(decode.rec.done) == 2)
        assert all(values is None for *_, values in decode.rec.layers)
        untouched = torch.ones(decode.pool.kv.shape[1], dtype=torch.bool, device=DEVICE)
        for room, (pages, tokens) in rooms.items():
            assert landed(decode, room, pages, tokens), f"room {room}: rows differ"
            untouched[token_slots(pages, tokens, PAGE).to(DEVICE)] = False
        assert bool((decode.pool.kv[:, untouched] == -1).all()), "rows landed outside the rooms' slots"
    finally:
        prefill.close()


def test_decode_cancel_mid_transfer(cleanup, prefill):
    decode = ipc_decode(cleanup)
    pages = decode.reserve(3, 40)
    prefill.send_room(decode.receiver.endpoint, 3, pages, 40, layers=[0])
    wait_until(lambda: 3 in decode.receiver.rooms and decode.receiver.rooms[3].granted)
    assert decode.cancel(3) is False, "granted: the pages go once the sender released them"
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=10)
    assert decode.rec.failed[0][1].kind == "aborted" and decode.idle
    for layer in (1, 2, 3):  # after the cancel: nothing more is written
        prefill.do("layer", 3, layer=layer)
    prefill.do("finish", 3)
    assert prefill.outcome(3) == "failed 3 aborted"
    pages = decode.reserve(4, 40)
    prefill.send_room(decode.receiver.endpoint, 4, pages, 40)
    prefill.do("finish", 4)
    assert prefill.outcome(4) == "done 4 cuda_ipc"
    decode.rec.wait_for(lambda: decode.rec.done)
    assert landed(decode, 4, pages, 40) and decode.idle


def test_transfer_timeout_and_prefill_abort(cleanup, prefill):
    decode = ipc_decode(cleanup, timeout_s=1.0)
    pages = decode.reserve(9, 40)
    prefill.send_room(decode.receiver.endpoint, 9, pages, 40, layers=[0, 1])  # then prefill stalls
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=5)
    assert decode.rec.failed[0][1].kind == "timeout" and decode.idle
    assert prefill.outcome(9) == "failed 9 timeout"
    pages = decode.reserve(10, 40)
    prefill.send_room(decode.receiver.endpoint, 10, pages, 40, layers=[0, 1])
    prefill.do("abort", 10)
    decode.rec.wait_for(lambda: len(decode.rec.failed) == 2, timeout=5)
    assert decode.rec.failed[1][1].kind == "aborted" and decode.idle
    assert prefill.outcome(10) == "failed 10 aborted"


def test_prefill_killed_mid_transfer(cleanup, prefill):
    decode = ipc_decode(cleanup)
    pages = decode.reserve(21, 40)
    prefill.send_room(decode.receiver.endpoint, 21, pages, 40, layers=[0])
    wait_until(lambda: 21 in decode.receiver.rooms and decode.receiver.rooms[21].granted)
    prefill.do("stall", 21)
    prefill.ask("layer", 21, layer=1)  # its writer thread is now stuck inside the room's copy
    time.sleep(0.2)
    prefill.proc.send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=10)
    (room, error, t_failed), = decode.rec.failed
    assert room == 21 and error.kind == "peer_failed" and t_failed - t_kill < 5.0
    assert decode.idle, "the decode worker freed the room's pages without a restart"
    again = Prefill()  # a new prefill process maps the same pool again
    try:
        pages = decode.reserve(22, 40)
        again.send_room(decode.receiver.endpoint, 22, pages, 40)
        again.do("finish", 22)
        assert again.outcome(22) == "done 22 cuda_ipc"
        decode.rec.wait_for(lambda: decode.rec.done)
        assert landed(decode, 22, pages, 40)
    finally:
        again.close()


RECEIVER_SCRIPT = """
import sys, time, torch
sys.path.insert(0, "tests")
from test_gpu_kv_ipc import DEVICE, KV_DIM, LAYERS, layout
from pdserve.kv_transfer import CudaIpcKVReceiver
say = lambda *words: print(*words, flush=True)
torch.cuda.set_device(DEVICE)
kv = torch.zeros(LAYERS, 1024, KV_DIM, dtype=torch.bfloat16, device=DEVICE)
receiver = CudaIpcKVReceiver(layout(), port=int(sys.argv[1]), kv_buffer=kv,
                             on_layer=lambda room, layer, slots, values: say("layer", room, layer),
                             on_done=lambda room, aux: say("done", room), on_failed=lambda room, e: say("failed", room))
receiver.expect(int(sys.argv[2]), 40, [3, 4, 9], LAYERS)
say("ready", receiver.endpoint)
time.sleep(120)
"""


def test_decode_killed_mid_transfer(cleanup):
    from stack import free_port

    port = free_port()
    start_decode = lambda room: subprocess.Popen(  # noqa: E731
        [sys.executable, "-c", RECEIVER_SCRIPT, str(port), str(room)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    procs = [start_decode(31)]
    try:
        endpoint = read_line(procs[0], "ready", 60.0).split()[1]
        s = CudaIpcKVSender(layout(), device=DEVICE)
        cleanup(s)
        h = s.begin(endpoint, 31, LAYERS, dst_pages=[3, 4, 9])
        h.send_layer(0, rows_for(31, 0, 40).to(DEVICE))
        wait_until(lambda: h.plane_state.granted.is_set(), timeout=10)
        procs[0].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        h.send_layer(1, rows_for(31, 1, 40).to(DEVICE))  # never raises, never hangs
        with pytest.raises(KVTransferError) as err:
            h.wait(timeout=30)
        assert err.value.kind == "peer_failed" and time.monotonic() - t_kill < 5.0
        conn = next(iter(s._conns.values()))
        wait_until(lambda: conn.plane.remote is None, timeout=5)  # the mapping was dropped once its copies finished
        torch.cuda.synchronize()  # this process's context is healthy
        procs.append(start_decode(32))
        read_line(procs[1], "ready", 60.0)
        h = s.begin(endpoint, 32, LAYERS, dst_pages=[3, 4, 9])  # a new mapping of the restarted decode's pool
        for layer in range(LAYERS):
            h.send_layer(layer, rows_for(32, layer, 40).to(DEVICE))
        h.finish(AUX)
        h.wait(timeout=30)
        read_line(procs[1], "done 32", 10.0)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_many_pairings_leak_no_mappings_or_memory(cleanup, prefill):
    decode = ipc_decode(cleanup)

    def pair(room: int) -> None:  # a room over a new connection that maps the pool, then dropped
        pages = decode.reserve(room, 40)
        prefill.send_room(decode.receiver.endpoint, room, pages, 40)
        prefill.do("finish", room)
        assert prefill.outcome(room) == f"done {room} cuda_ipc"
        prefill.do("repair")

    # NOTE: the first pairings take ~70 MiB once (tcp too: CUDA context pieces, streams and allocator blocks of the
    # prefill process); a leak is what grows with every pairing after them, so the measurement starts there.
    torch.cuda.synchronize()
    free_start = torch.cuda.mem_get_info()[0]
    warmup, measured = range(100, 103), range(103, 133)
    for room in warmup:
        pair(room)
    decode.rec.wait_for(lambda: len(decode.rec.done) == len(warmup))
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    for room in measured:
        pair(room)
    decode.rec.wait_for(lambda: len(decode.rec.done) == len(warmup) + len(measured))
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"GPU free memory: {mib(free_start):.1f} MiB at the start, {mib(free_before):.1f} after {len(warmup)} "
          f"warm-up pairings (one-time {mib(free_start - free_before):.1f} MiB), {mib(free_after):.1f} after "
          f"{len(measured)} more (growth {mib(free_before - free_after):.1f} MiB)")
    # Under 0.5 MiB a pairing on average, where the one-time cost is ~70 MiB: what each pairing leaves behind.
    assert free_before - free_after < 16 * 2**20, "re-pairing leaks GPU memory"
    assert decode.idle and decode.receiver.num_pending == 0


@pytest.mark.parametrize("model", ["tiny_v3_dir", "trained_model_dir"])  # a random V3 layout; the demo model
def test_outputs_match_the_single_process_engine(model, tmp_path, request):
    """Prefill and decode on one GPU, KV over cuda_ipc (picked by auto): the single-process engine's greedy tokens
    (the CPU reference: GPU fp32 with these backends equals it, tests/test_gpu_engine.py)."""
    from golden import reference_outputs

    model_dir = request.getfixturevalue(model)
    reference = reference_outputs(model_dir, dtype="float32")  # the stack below runs in fp32 too
    stack = start_pd_on_gpus(model_dir, tmp_path, "auto", DEVICE, DEVICE)  # (one GPU: both on it)
    (prefill_proc,) = stack.prefill
    try:
        check_against_reference(stack.router.address, reference)
        assert metric(prefill_proc.metrics_port, "pdserve_kv_transfer_bytes_total", transport="cuda_ipc") > 0
        assert "over cuda_ipc (same GPU)" in prefill_proc.log_path.read_text()
    finally:
        stack.stop()
