"""The "nccl" KV transport between two GPUs of one host: prefill rows on cuda:0, the decode pool on cuda:1, each side
in its own process (NCCL pairs two processes on two devices, as in deployment). The cases of
tests/test_kv_transfer_collective.py (which runs them over Gloo on the CPU) plus golden outputs through the whole
stack. Skipped without two CUDA GPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pdserve.kv_transfer import KVLayout, KVTransferError, NcclKVSender, token_slots
from stack import free_port, start_pd_on_gpus
from test_kv_transfer_collective import Decode, read_line, wait_until
from golden import check_against_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# NOTE: as `pdserve prefill/decode --kv-transport nccl` run (pdserve.cli.serve): the transport aborts a failed pair itself;
# torch's default error handling would take the whole process down. Inherited by the processes started here.
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
PREFILL_DEVICE, DECODE_DEVICE = "cuda:0", "cuda:1"
PAGE, LAYERS, KV_DIM, NUM_PAGES = 16, 4, 576, 64  # DeepSeek-V3's latent width, bf16
AUX = {"first_token_id": 7, "cached_tokens": 0, "hidden": None, "rng_state": b""}


def layout() -> KVLayout:
    return KVLayout("tiny-dsv3@nccl", PAGE, LAYERS, KV_DIM, "bfloat16")


def rows_for(room: int, layer: int, num_tokens: int) -> torch.Tensor:
    """The rows prefill sends for (room, layer): reproducible in both processes. (num_tokens, KV_DIM) bf16."""
    gen = torch.Generator().manual_seed(room * 1000 + layer)
    return torch.randn(num_tokens, KV_DIM, generator=gen).to(torch.bfloat16)


# A prefill process driven over stdin, one JSON command a line, answering on stdout.
SENDER_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_gpu_kv_nccl import PREFILL_DEVICE, AUX, layout, rows_for
from pdserve.kv_transfer import KVTransferError, NcclKVSender
sender, handles = NcclKVSender(layout(), device=PREFILL_DEVICE), {}
print("ready", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    room = cmd.get("room")
    if cmd["op"] == "begin":
        handles[room] = (sender.begin(cmd["endpoint"], room, layout().num_kv_layers, dst_pages=cmd["pages"]),
                         cmd["tokens"])
    elif cmd["op"] == "layer":
        h, n = handles[room]
        h.send_layer(cmd["layer"], rows_for(room, cmd["layer"], n).to(PREFILL_DEVICE))
    elif cmd["op"] == "finish":
        handles[room][0].finish(AUX)
    elif cmd["op"] == "wait":
        try:
            handles[room][0].wait(timeout=30)
            print("done", room, flush=True)
        except KVTransferError as e:
            print("failed", room, e.kind, flush=True)
    elif cmd["op"] == "stall":  # fault: what is announced from now on is never sent
        h, _ = handles[room]
        h._conn.plane.pair.post = lambda *args, **kw: None
    print("ok", cmd["op"], room, flush=True)
"""


class Prefill:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", SENDER_SCRIPT], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        read_line(self.proc, "ready", 60.0)

    def do(self, op: str, room: int, **fields) -> None:
        self.ask(op, room, **fields)
        read_line(self.proc, f"ok {op} {room}", 30.0)

    def ask(self, op: str, room: int, **fields) -> None:
        self.proc.stdin.write(json.dumps({"op": op, "room": room, **fields}) + "\n")
        self.proc.stdin.flush()

    def send_room(self, endpoint: str, room: int, pages: list[int], tokens: int, layers=range(LAYERS)) -> None:
        self.do("begin", room, endpoint=endpoint, pages=pages, tokens=tokens)
        for layer in layers:
            self.do("layer", room, layer=layer)

    def outcome(self, room: int) -> str:
        """ "done R" or "failed R KIND" (printed before "ok wait R")."""
        self.ask("wait", room)
        line = read_line(self.proc, "", 40.0)
        read_line(self.proc, f"ok wait {room}", 5.0)
        return line

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def nccl_decode(cleanup, **options) -> Decode:
    """A decode pool on DECODE_DEVICE with an nccl receiver (the harness of the Gloo tests)."""
    return Decode(cleanup, layout(), transport="nccl", device=DECODE_DEVICE, num_pages=NUM_PAGES, **options)


def landed(decode: Decode, room: int, pages: list[int], tokens: int) -> bool:
    slots = token_slots(pages, tokens, PAGE).to(DECODE_DEVICE)
    return all(torch.equal(decode.pool.kv[layer, slots].cpu(), rows_for(room, layer, tokens))
               for layer in range(LAYERS))


@pytest.fixture
def prefill():
    p = Prefill()
    yield p
    p.close()


def test_rows_land_bit_identical_in_scattered_pages(cleanup, prefill):
    decode = nccl_decode(cleanup)
    decode.pool.allocator.alloc(NUM_PAGES)  # the test hands out its own scattered pages
    rooms = {1: ([9, 2, 5, 6, 7, 0, 13, 11], 117), 2: ([20, 21, 22, 40, 41], 65)}  # runs break where pages jump
    for room, (pages, tokens) in rooms.items():
        decode.reserve(room, tokens, pages)
        prefill.do("begin", room, endpoint=decode.receiver.endpoint, pages=pages, tokens=tokens)
    for layer in range(LAYERS):  # interleaved rooms over one process group
        for room in rooms:
            prefill.do("layer", room, layer=layer)
    for room in rooms:
        prefill.do("finish", room)
    assert [prefill.outcome(room) for room in rooms] == ["done 1", "done 2"]
    decode.rec.wait_for(lambda: len(decode.rec.done) == 2)
    assert all(values is None for *_, values in decode.rec.layers)
    untouched = torch.ones(decode.pool.kv.shape[1], dtype=torch.bool, device=DECODE_DEVICE)
    for room, (pages, tokens) in rooms.items():
        assert landed(decode, room, pages, tokens), f"room {room}: rows differ"
        untouched[token_slots(pages, tokens, PAGE).to(DECODE_DEVICE)] = False
    assert bool((decode.pool.kv[:, untouched] == -1).all()), "rows landed outside the rooms' slots"


def test_decode_cancel_mid_transfer(cleanup, prefill):
    decode = nccl_decode(cleanup)
    pages = decode.reserve(3, 40)
    prefill.send_room(decode.receiver.endpoint, 3, pages, 40, layers=[0])
    decode.rec.wait_for(lambda: decode.rec.layers, timeout=10)
    assert decode.cancel(3) is True and decode.idle
    for layer in (1, 2, 3):  # announced after the cancel: received into scratch, never into the freed pages
        prefill.do("layer", 3, layer=layer)
    prefill.do("finish", 3)
    assert prefill.outcome(3) == "failed 3 aborted"
    pages = decode.reserve(4, 40)
    prefill.send_room(decode.receiver.endpoint, 4, pages, 40)
    prefill.do("finish", 4)
    assert prefill.outcome(4) == "done 4"
    decode.rec.wait_for(lambda: decode.rec.done)
    assert landed(decode, 4, pages, 40) and decode.idle


def test_transfer_timeout(cleanup, prefill):
    decode = nccl_decode(cleanup, timeout_s=1.0)
    pages = decode.reserve(9, 40)
    prefill.send_room(decode.receiver.endpoint, 9, pages, 40, layers=[0, 1])  # then prefill stalls
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=5)
    assert decode.rec.failed[0][1].kind == "timeout" and decode.idle
    assert prefill.outcome(9) == "failed 9 timeout"


def test_prefill_killed_mid_transfer(cleanup, prefill):
    decode = nccl_decode(cleanup)
    pages = decode.reserve(21, 40)
    prefill.send_room(decode.receiver.endpoint, 21, pages, 40, layers=[0])
    decode.rec.wait_for(lambda: decode.rec.layers, timeout=10)
    prefill.do("stall", 21)
    prefill.do("layer", 21, layer=1)  # announced, never sent: a receive stays in flight in the pages
    wait_until(lambda: decode.receiver.rooms[21].inflight == 1)
    prefill.proc.send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=10)
    (room, error, t_failed), = decode.rec.failed
    assert room == 21 and error.kind == "peer_failed" and t_failed - t_kill < 5.0
    assert decode.idle, "the NCCL group was not aborted: the receive still holds the pages"
    again = Prefill()  # a new prefill process pairs with the same receiver over a new communicator
    try:
        pages = decode.reserve(22, 40)
        again.send_room(decode.receiver.endpoint, 22, pages, 40)
        again.do("finish", 22)
        assert again.outcome(22) == "done 22"
        decode.rec.wait_for(lambda: decode.rec.done)
        assert landed(decode, 22, pages, 40)
    finally:
        again.close()


RECEIVER_SCRIPT = """
import sys, time, torch
sys.path.insert(0, "tests")
from test_gpu_kv_nccl import DECODE_DEVICE, KV_DIM, LAYERS, layout
from pdserve.kv_transfer import NcclKVReceiver
say = lambda *words: print(*words, flush=True)
torch.cuda.set_device(DECODE_DEVICE)
kv = torch.zeros(LAYERS, 1024, KV_DIM, dtype=torch.bfloat16, device=DECODE_DEVICE)
receiver = NcclKVReceiver(layout(), port=int(sys.argv[1]), kv_buffer=kv,
                          on_layer=lambda room, layer, slots, values: say("layer", room, layer),
                          on_done=lambda room, aux: say("done", room), on_failed=lambda room, e: say("failed", room))
receiver.expect(int(sys.argv[2]), 40, [3, 4, 9], LAYERS)
say("ready", receiver.endpoint)
time.sleep(120)
"""


def test_decode_killed_mid_transfer(cleanup):
    port = free_port()
    start_decode = lambda room: subprocess.Popen(  # noqa: E731
        [sys.executable, "-c", RECEIVER_SCRIPT, str(port), str(room)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    procs = [start_decode(31)]
    try:
        endpoint = read_line(procs[0], "ready", 60.0).split()[1]
        s = NcclKVSender(layout(), device=PREFILL_DEVICE)
        cleanup(s)
        h = s.begin(endpoint, 31, LAYERS, dst_pages=[3, 4, 9])
        h.send_layer(0, rows_for(31, 0, 40).to(PREFILL_DEVICE))
        read_line(procs[0], "layer 31 0", 10.0)
        procs[0].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        h.send_layer(1, rows_for(31, 1, 40).to(PREFILL_DEVICE))  # never raises, never hangs
        with pytest.raises(KVTransferError) as err:
            h.wait(timeout=30)
        assert err.value.kind == "peer_failed" and time.monotonic() - t_kill < 5.0
        procs.append(start_decode(32))
        read_line(procs[1], "ready", 60.0)
        h = s.begin(endpoint, 32, LAYERS, dst_pages=[3, 4, 9])  # a new communicator with the restarted decode
        for layer in range(LAYERS):
            h.send_layer(layer, rows_for(32, layer, 40).to(PREFILL_DEVICE))
        h.finish(AUX)
        h.wait(timeout=30)
        read_line(procs[1], "done 32", 10.0)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_outputs_match_the_single_process_engine(tiny_v3_dir, tmp_path, reference):
    """Prefill on cuda:0, decode on cuda:1, KV over NCCL: the single-process engine's greedy tokens (the CPU
    reference: GPU fp32 with these backends equals it, tests/test_gpu_engine.py)."""
    stack = start_pd_on_gpus(tiny_v3_dir, tmp_path, "nccl", PREFILL_DEVICE, DECODE_DEVICE)
    try:
        check_against_reference(stack.router.address, reference)
    finally:
        stack.stop()
