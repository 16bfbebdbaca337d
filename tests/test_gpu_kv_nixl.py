"""The "nixl" KV transport between two GPUs of one host, VRAM to VRAM: prefill rows on cuda:0 in this process, the
decode pool on cuda:1 in a process of its own (as in deployment: UCX should pick cuda_ipc, NVLink or PCIe peer
writes). The CPU cases are tests/test_kv_transfer_nixl.py; here the rows land bit-identical in contiguous and in
shuffled (staged, scattered on cuda:1) pages, a killed decode process fails its room, and the whole stack gives the
single-process engine's greedy tokens. Skipped without two CUDA GPUs."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from pdserve.kv_transfer import KVLayout, KVTransferError, NixlKVSender
from stack import metric, start_pd_on_gpus, wait_idle
from test_kv_transfer_collective import read_line
from golden import check_against_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFILL_DEVICE, DECODE_DEVICE = "cuda:0", "cuda:1"
PAGE, LAYERS, KV_DIM, NUM_PAGES = 16, 4, 576, 256  # DeepSeek-V3's latent width, bf16
AUX = {"first_token_id": 7, "cached_tokens": 0, "hidden": None, "rng_state": b""}


def layout() -> KVLayout:
    return KVLayout("tiny-dsv3@nixl", PAGE, LAYERS, KV_DIM, "bfloat16")


def rows_for(room: int, num_tokens: int) -> torch.Tensor:
    """The rows prefill sends for `room`, reproducible in both processes: (LAYERS, num_tokens, KV_DIM) bf16."""
    return torch.randn(LAYERS, num_tokens, KV_DIM, generator=torch.Generator().manual_seed(room)).to(torch.bfloat16)


# The decode side: a pool on cuda:1, rooms expected on stdin ("room tokens pages"), each checked when it is done.
RECEIVER_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_gpu_kv_nixl import DECODE_DEVICE, NUM_PAGES, PAGE, layout, rows_for
from pdserve.kv_transfer import NixlKVReceiver, token_slots
torch.cuda.set_device(DECODE_DEVICE)
pool = torch.full((layout().num_kv_layers, (NUM_PAGES + 1) * PAGE, layout().kv_dim), -1.0, dtype=torch.bfloat16,
                  device=DECODE_DEVICE)
say, rooms = lambda *words: print(*words, flush=True), {}

def done(room, aux):
    n, pages = rooms[room]
    slots = token_slots(pages, n, PAGE, device=DECODE_DEVICE)
    say("done", room, "ok" if torch.equal(pool[:, slots].cpu(), rows_for(room, n)) else "bad")

receiver = NixlKVReceiver(layout(), port=int(sys.argv[1]), kv_buffer=pool, on_layer=lambda *a: None, on_done=done,
                          on_failed=lambda room, e: say("failed", room, e.kind))
say("ready", receiver.endpoint)
for line in sys.stdin:
    room, n, pages = line.split(maxsplit=2)
    rooms[int(room)] = (int(n), json.loads(pages))
    receiver.expect(int(room), int(n), json.loads(pages), layout().num_kv_layers)
    say("expected", room)
"""


def start_decode(port: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RECEIVER_SCRIPT, str(port)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def expect(proc: subprocess.Popen, room: int, n: int, pages: list[int]) -> None:
    proc.stdin.write(f"{room} {n} {json.dumps(pages)}\n")
    proc.stdin.flush()
    read_line(proc, f"expected {room}", 10.0)


def send(sender, endpoint: str, room: int, n: int, pages: list[int], whole: bool):
    h = sender.begin(endpoint, room, LAYERS, dst_pages=pages)
    rows = rows_for(room, n).to(PREFILL_DEVICE)
    if whole:
        h.send_layers(0, rows)
    else:
        for layer in range(LAYERS):
            h.send_layer(layer, rows[layer])
    h.finish(AUX)
    return h


def test_rows_land_bit_identical_in_the_decode_gpus_pages(cleanup):
    proc = start_decode()
    try:
        endpoint = read_line(proc, "ready", 120.0).split()[1]
        s = NixlKVSender(layout(), device=PREFILL_DEVICE)
        cleanup(s)
        room = 1
        for order in ("contiguous", "shuffled"):  # shuffled: more runs than MAX_DIRECT_RUNS, so staged
            for n in (1, 40, 1000):
                for whole in (True, False):
                    pages = list(range(-(-n // PAGE)))
                    if order == "shuffled":
                        random.Random(room).shuffle(pages)
                    expect(proc, room, n, pages)
                    h = send(s, endpoint, room, n, pages, whole)
                    h.wait(timeout=60)
                    assert read_line(proc, f"done {room}", 10.0) == f"done {room} ok", (order, n, whole)
                    room += 1
        assert h.transport == "nixl" and "cuda_ipc" in h.link, h.link  # UCX's pick between two GPUs of a host
    finally:
        proc.kill()
        proc.wait()


def test_decode_killed_mid_transfer(cleanup):
    proc = start_decode()
    procs = [proc]
    try:
        endpoint = read_line(proc, "ready", 120.0).split()[1]
        s = NixlKVSender(layout(), device=PREFILL_DEVICE)
        cleanup(s)
        expect(proc, 31, 40, [3, 4, 9])
        h = s.begin(endpoint, 31, LAYERS, dst_pages=[3, 4, 9])
        h.send_layer(0, rows_for(31, 40)[0].to(PREFILL_DEVICE))
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t_kill = time.monotonic()
        h.send_layer(1, rows_for(31, 40)[1].to(PREFILL_DEVICE))  # never raises, never hangs
        with pytest.raises(KVTransferError) as err:
            h.wait(timeout=30)
        assert err.value.kind == "peer_failed" and time.monotonic() - t_kill < 5.0
        procs.append(start_decode(int(endpoint.rsplit(":", 1)[1])))  # restarted on the same port: a new pairing
        read_line(procs[1], "ready", 120.0)
        expect(procs[1], 32, 40, [3, 4, 9])
        send(s, endpoint, 32, 40, [3, 4, 9], whole=True).wait(timeout=60)
        assert read_line(procs[1], "done 32", 10.0) == "done 32 ok"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_outputs_match_the_single_process_engine(tiny_v3_dir, tmp_path, reference):
    """Prefill on cuda:0, decode on cuda:1, KV over NIXL: the single-process engine's greedy tokens (the CPU
    reference: GPU fp32 with these backends equals it, tests/test_gpu_engine.py), the pools idle after."""
    stack = start_pd_on_gpus(tiny_v3_dir, tmp_path, "nixl", PREFILL_DEVICE, DECODE_DEVICE)
    (prefill_proc,), (decode_proc,) = stack.prefill, stack.decode
    try:
        check_against_reference(stack.router.address, reference)
        assert metric(prefill_proc.metrics_port, "pdserve_kv_transfer_bytes_total", transport="nixl") > 0
        for proc in (prefill_proc, decode_proc):
            idle = wait_idle(proc)
            assert idle.num_free_pages == idle.num_total_pages, f"{proc.role} holds pages: {idle}"
    finally:
        stack.stop()
