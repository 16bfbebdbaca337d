"""The collective KV transport over Gloo (the CPU twin of "nccl", same code): rows received straight into the decode
pool's pages over a real torch.distributed process group, control over real sockets, faults with real processes
(a prefill or decode process SIGKILLed mid-transfer). tests/test_gpu_kv_nccl.py runs the same cases over NCCL."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from pdserve.kv_cache import CacheConfig, LatentKVPool
from pdserve.kv_transfer import collective_pair
from pdserve.kv_transfer import (
    TRANSPORTS, GlooKVReceiver, GlooKVSender, KVReceiverChannel, KVSenderChannel, KVTransferError, TransferState,
    token_slots,
)

from stack import free_port
from test_kv_transfer_tcp import KV_DIM, LAYERS, PAGE, TOKENS, Recorder, expected_slots, make_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_PAGES = 16
AUX = {"first_token_id": 7, "cached_tokens": 0, "hidden": None, "rng_state": b""}


class Decode:
    """The decode engine's part of a transfer: reserves pool pages, frees them on the receiver's last word."""

    def __init__(self, cleanup, layout=None, transport: str = "gloo", device: str = "cpu",
                 num_pages: int = NUM_PAGES, **options):
        self.layout, self.num_pages = layout or make_layout(), num_pages
        self.pool = LatentKVPool(self.layout.num_kv_layers, self.layout.kv_dim,
                                 CacheConfig(page_size=self.layout.page_size, num_pages=num_pages),
                                 dtype=self.layout.torch_dtype, device=device)
        self.pool.kv.fill_(-1.0)  # poisoned: a row that was not received shows
        self.rec = Recorder()
        self.pages: dict[int, list[int]] = {}
        self.receiver = TRANSPORTS.get(transport).receiver(
            self.layout, kv_buffer=self.pool.kv, on_layer=self.rec.on_layer, on_done=self._finished(self.rec.on_done),
            on_failed=self._finished(self.rec.on_failed), **options)
        cleanup(self.receiver)

    def record_frames(self) -> list[tuple[str, object]]:
        """From now on, (kind, layers or layer) of every data frame the receiver takes, in order (still handled)."""
        frames, on_data = [], self.receiver._on_data
        self.receiver._on_data = lambda conn, kind, header, payload: (
            frames.append((kind, header.get("layers", header.get("layer")))), on_data(conn, kind, header, payload))[1]
        return frames

    def _finished(self, record):
        def callback(room, arg):
            self.pool.allocator.decref(self.pages.pop(room))
            record(room, arg)
        return callback

    def reserve(self, room: int, num_tokens: int, pages: list[int] | None = None) -> list[int]:
        """Allocates the pages, or takes `pages` (the test allocated them itself, scattered)."""
        pages = pages if pages is not None else self.pool.allocator.alloc(-(-num_tokens // self.layout.page_size))
        self.pages[room] = pages
        self.receiver.expect(room, num_tokens, pages, self.layout.num_kv_layers)
        return pages

    def cancel(self, room: int) -> bool:
        dropped = self.receiver.cancel(room)
        if dropped:
            self.pool.allocator.decref(self.pages.pop(room))
        return dropped

    @property
    def idle(self) -> bool:
        return self.pool.allocator.num_free == self.num_pages and not self.pages


def sender(cleanup, layout=None, **options) -> GlooKVSender:
    s = GlooKVSender(layout or make_layout(), **options)
    cleanup(s)
    return s


def send_room(s, endpoint, room, rows: torch.Tensor, pages: list[int]):
    h = s.begin(endpoint, room, LAYERS, dst_pages=pages)
    for layer in range(LAYERS):
        h.send_layer(layer, rows[layer])
    h.finish(AUX)
    return h


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_land_bit_identical_in_scattered_pages(cleanup, dtype):
    layout = make_layout(dtype)
    decode = Decode(cleanup, layout)
    s = sender(cleanup, layout)
    dst = [9, 2, 5, 6, 7, 0, 13, 11, 12, 3]  # 37 tokens over 10 pages: several runs, partial last page
    decode.pool.allocator.alloc(NUM_PAGES)  # the test hands out its own scattered pages
    rows = torch.randn(LAYERS, TOKENS, KV_DIM).to(layout.torch_dtype)
    decode.reserve(42, TOKENS, dst)
    stats = send_room(s, decode.receiver.endpoint, 42, rows, dst).wait(timeout=5)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert stats.bytes_sent >= rows.numel() * rows.element_size()
    assert [(room, layer) for room, layer, _, _ in decode.rec.layers] == [(42, 0), (42, 1), (42, 2)]
    slots = token_slots(dst, TOKENS, PAGE)
    for _, layer, got_slots, values in decode.rec.layers:
        assert values is None, "the rows are already in the pool: on_layer carries none"
        assert got_slots.tolist() == expected_slots(dst, TOKENS, PAGE)
        assert torch.equal(decode.pool.kv[layer, slots].view(torch.uint8), rows[layer].view(torch.uint8))
    untouched = torch.ones(decode.pool.kv.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert (decode.pool.kv[:, untouched] == -1).all(), "a slot outside the room's pages was written"
    (room, aux), = decode.rec.done
    assert room == 42 and aux["first_token_id"] == 7 and not decode.rec.failed


def test_interleaved_rooms_share_one_process_group(cleanup):
    decode = Decode(cleanup)
    s = sender(cleanup)
    rows = {room: torch.randn(LAYERS, n, KV_DIM) for room, n in ((1, 5), (2**64 - 1, 13))}
    handles = {}
    for room, r in rows.items():
        pages = decode.reserve(room, r.shape[1])
        handles[room] = (s.begin(decode.receiver.endpoint, room, LAYERS, dst_pages=pages), pages)
    for layer in range(LAYERS):
        for room, (h, _) in handles.items():
            h.send_layer(layer, rows[room][layer])
    for h, _ in handles.values():
        h.finish(AUX)
    for h, _ in handles.values():
        h.wait(timeout=5)
    assert len(s._conns) == 1, "both rooms go over one connection and one process group"
    decode.rec.wait_for(lambda: len(decode.rec.done) == 2)
    for room, (_, pages) in handles.items():
        n = rows[room].shape[1]
        for layer in range(LAYERS):
            assert torch.equal(decode.pool.kv[layer, token_slots(pages, n, PAGE)], rows[room][layer])
    assert decode.idle


@pytest.mark.parametrize("prefill, decode", [("gloo", "tcp"), ("tcp", "gloo")])
def test_different_transports_are_refused_at_the_handshake(cleanup, prefill, decode):
    layout = make_layout()
    rec = Recorder()
    kv = torch.zeros(LAYERS, NUM_PAGES * PAGE, KV_DIM)
    receiver = TRANSPORTS.get(decode).receiver(layout, on_layer=rec.on_layer, on_done=rec.on_done,
                                               on_failed=rec.on_failed, kv_buffer=kv)
    cleanup(receiver)
    s = TRANSPORTS.get(prefill).sender(layout)
    cleanup(s)
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as err:
        s.begin(receiver.endpoint, 5, LAYERS, dst_pages=[0])
    assert err.value.kind == "incompatible" and time.monotonic() - t0 < 2.0
    assert f"prefill {prefill!r} vs decode {decode!r}" in str(err.value)
    assert isinstance(receiver, KVReceiverChannel) and isinstance(s, KVSenderChannel)  # the same control channel


def test_timeout_frees_the_pages_and_the_pair_carries_on(cleanup):
    decode = Decode(cleanup, timeout_s=0.6)
    s = sender(cleanup)
    pages = decode.reserve(9, 6)
    h = s.begin(decode.receiver.endpoint, 9, LAYERS, dst_pages=pages)
    h.send_layer(0, torch.ones(6, KV_DIM))  # then prefill stalls
    t0 = time.monotonic()
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=3.0)
    (room, error, t_failed), = decode.rec.failed
    assert room == 9 and error.kind == "timeout" and "1/3 layers" in str(error)
    assert t_failed - t0 < 1.0 and decode.idle
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=3)
    assert err.value.kind == "timeout"
    h.send_layer(1, torch.ones(6, KV_DIM))  # announced before prefill heard: received into scratch, not the pool
    conn = s._conns[decode.receiver.endpoint]
    pages = decode.reserve(10, 6)
    send_room(s, decode.receiver.endpoint, 10, torch.full((LAYERS, 6, KV_DIM), 3.0), pages).wait(timeout=5)
    assert s._conns[decode.receiver.endpoint] is conn, "a timed-out room does not cost the pair its group"
    decode.rec.wait_for(lambda: decode.rec.done)
    assert (decode.pool.kv[:, token_slots(pages, 6, PAGE)] == 3.0).all() and decode.idle


def test_decode_cancel_mid_transfer(cleanup):
    decode = Decode(cleanup)
    s = sender(cleanup)
    pages = decode.reserve(3, 6)
    h = s.begin(decode.receiver.endpoint, 3, LAYERS, dst_pages=pages)
    h.send_layer(0, torch.ones(6, KV_DIM))
    decode.rec.wait_for(lambda: decode.rec.layers)
    assert decode.cancel(3) is True and decode.idle  # nothing in flight: the pages are free at once
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=3)
    assert err.value.kind == "aborted" and time.monotonic() - t0 < 1.0
    h.send_layer(1, torch.ones(6, KV_DIM))  # never raises; nothing lands in the freed pages
    pages = decode.reserve(4, 6)
    send_room(s, decode.receiver.endpoint, 4, torch.full((LAYERS, 6, KV_DIM), 5.0), pages).wait(timeout=5)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert [room for room, *_ in decode.rec.layers] == [3, 4, 4, 4] and not decode.rec.failed and decode.idle


@pytest.mark.parametrize("room_state", ["cancelled", "never expected"])
def test_ops_announced_for_a_dead_room_are_received_into_scratch(cleanup, room_state):
    decode = Decode(cleanup)
    s = sender(cleanup)
    if room_state == "cancelled":
        decode.reserve(4, 6)
        assert decode.cancel(4) is True  # before prefill sent anything: its announcements are still coming
    h = s.begin(decode.receiver.endpoint, 4, LAYERS, dst_pages=[0, 1])
    h.send_layer(0, torch.full((6, KV_DIM), 9.0))  # announced and sent before prefill hears the room is gone
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=3)
    assert err.value.kind == ("aborted" if room_state == "cancelled" else "protocol")
    pages = decode.reserve(5, 6)
    send_room(s, decode.receiver.endpoint, 5, torch.full((LAYERS, 6, KV_DIM), 4.0), pages).wait(timeout=5)
    decode.rec.wait_for(lambda: decode.rec.done)
    slots = token_slots(pages, 6, PAGE)
    assert (decode.pool.kv[:, slots] == 4.0).all(), "the op streams went out of step"
    others = torch.ones(decode.pool.kv.shape[1], dtype=torch.bool)
    others[slots] = False
    assert (decode.pool.kv[:, others] == -1).all(), "the dead room's rows landed in the pool"
    assert not decode.rec.failed and decode.idle


def test_stuck_receives_hold_the_pages_until_the_pair_is_torn_down_and_rebuilt(cleanup):
    decode = Decode(cleanup, drain_timeout_s=0.3)
    s = sender(cleanup)
    pages = decode.reserve(5, 6)
    h = s.begin(decode.receiver.endpoint, 5, LAYERS, dst_pages=pages)
    h.send_layer(0, torch.ones(6, KV_DIM))
    decode.rec.wait_for(lambda: decode.rec.layers)
    conn = s._conns[decode.receiver.endpoint]
    conn.plane.pair.post = lambda *args, **kw: None  # fault: layer 1 is announced but its sends never posted
    h.send_layer(1, torch.ones(6, KV_DIM))
    wait_until(lambda: decode.receiver.rooms[5].inflight == 1)
    t0 = time.monotonic()
    assert decode.cancel(5) is False, "a receive is landing in the pages: they are not free yet"
    assert not decode.idle
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=5.0)  # drain timeout -> pair torn down -> resolved
    assert decode.rec.failed[0][1].kind == "aborted" and decode.idle and time.monotonic() - t0 < 3.0
    with pytest.raises(KVTransferError):
        h.wait(timeout=3)
    pages = decode.reserve(6, 6)
    send_room(s, decode.receiver.endpoint, 6, torch.full((LAYERS, 6, KV_DIM), 2.0), pages).wait(timeout=5)
    assert s._conns[decode.receiver.endpoint] is not conn, "the next room got a new process group"
    decode.rec.wait_for(lambda: decode.rec.done)
    assert (decode.pool.kv[:, token_slots(pages, 6, PAGE)] == 2.0).all() and decode.idle


SENDER_SCRIPT = """
import json, sys, time, torch
from pdserve.kv_transfer import KVLayout, GlooKVSender
layout, pages, n = KVLayout(**json.loads(sys.argv[1])), json.loads(sys.argv[4]), int(sys.argv[5])
handle = GlooKVSender(layout).begin(sys.argv[2], int(sys.argv[3]), layout.num_kv_layers, dst_pages=pages)
handle.send_layer(0, torch.ones(n, layout.kv_dim))
sys.stdin.readline()
handle._conn.plane.pair.post = lambda *args, **kw: None  # layer 1 is announced, its sends never leave: in flight
handle.send_layer(1, torch.ones(n, layout.kv_dim))
time.sleep(60)
"""


def test_prefill_killed_mid_transfer(cleanup):
    decode = Decode(cleanup)
    pages = decode.reserve(21, 5)
    proc = subprocess.Popen([sys.executable, "-c", SENDER_SCRIPT, json.dumps(decode.layout.to_dict()),
                             decode.receiver.endpoint, "21", json.dumps(pages), "5"], cwd=REPO, stdin=subprocess.PIPE,
                            text=True)
    try:
        decode.rec.wait_for(lambda: decode.rec.layers, timeout=20.0)  # the child imports torch first
        proc.stdin.write("go\n")
        proc.stdin.flush()
        wait_until(lambda: decode.receiver.rooms[21].inflight == 1)
        proc.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        decode.rec.wait_for(lambda: decode.rec.failed, timeout=3.0)
    finally:
        proc.kill()
        proc.wait()
    (room, error, t_failed), = decode.rec.failed
    assert room == 21 and error.kind == "peer_failed" and "1/3 layers" in str(error)
    assert t_failed - t_kill < 2.0 and decode.idle and decode.receiver.num_pending == 0
    s = sender(cleanup)  # the next prefill worker pairs with the same receiver over a new group
    pages = decode.reserve(22, 5)
    send_room(s, decode.receiver.endpoint, 22, torch.randn(LAYERS, 5, KV_DIM), pages).wait(timeout=10)


RECEIVER_SCRIPT = """
import json, sys, time, torch
from pdserve.kv_transfer import KVLayout, GlooKVReceiver
layout = KVLayout(**json.loads(sys.argv[1]))
say = lambda *words: print(*words, flush=True)
pool = torch.zeros(layout.num_kv_layers, 256, layout.kv_dim)
receiver = GlooKVReceiver(layout, port=int(sys.argv[2]), kv_buffer=pool,
                          on_layer=lambda room, layer, slots, values: say("layer", room, layer),
                          on_done=lambda room, aux: say("done", room), on_failed=lambda room, e: say("failed", room))
receiver.expect(int(sys.argv[3]), 6, [3, 4], layout.num_kv_layers)
say("ready", receiver.endpoint)
time.sleep(60)
"""


def test_decode_killed_mid_transfer(cleanup):
    layout, port = make_layout(), free_port()
    start = lambda room: subprocess.Popen(  # noqa: E731
        [sys.executable, "-c", RECEIVER_SCRIPT, json.dumps(layout.to_dict()), str(port), str(room)], cwd=REPO,
        stdout=subprocess.PIPE, text=True)
    procs = [start(31)]
    try:
        endpoint = read_line(procs[0], "ready", 20.0).split()[1]
        s = sender(cleanup, layout)
        h = s.begin(endpoint, 31, LAYERS, dst_pages=[3, 4])
        h.send_layer(0, torch.ones(6, KV_DIM))
        read_line(procs[0], "layer 31 0", 5.0)
        procs[0].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        h.send_layer(1, torch.ones(6, KV_DIM))  # never raises, never hangs
        with pytest.raises(KVTransferError) as err:
            h.wait(timeout=10)
        assert err.value.kind == "peer_failed" and time.monotonic() - t_kill < 2.0
        assert h.poll() == TransferState.FAILED
        procs.append(start(32))  # decode restarted on the same port: the next room builds a new group
        read_line(procs[1], "ready", 20.0)
        send_room(s, endpoint, 32, torch.ones(LAYERS, 6, KV_DIM), [3, 4]).wait(timeout=10)
        read_line(procs[1], "done 32", 5.0)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_receiver_needs_the_pool_and_sender_the_pages(cleanup):
    layout = make_layout()
    rec = Recorder()
    with pytest.raises(ValueError, match="kv_buffer"):
        GlooKVReceiver(layout, on_layer=rec.on_layer, on_done=rec.on_done, on_failed=rec.on_failed, kv_buffer=None)
    with pytest.raises(ValueError, match="kv_buffer"):
        GlooKVReceiver(layout, on_layer=rec.on_layer, on_done=rec.on_done, on_failed=rec.on_failed,
                       kv_buffer=torch.zeros(LAYERS, 64, KV_DIM, dtype=torch.bfloat16))
    decode = Decode(cleanup)
    s = sender(cleanup)
    with pytest.raises(ValueError, match="dst_pages"):
        s.begin(decode.receiver.endpoint, 1, LAYERS)
    h = s.begin(decode.receiver.endpoint, 2, LAYERS, dst_pages=[0])
    with pytest.raises(ValueError, match="destination pages"):
        h.send_layer(0, torch.ones(PAGE + 1, KV_DIM))


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def read_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The child's next stdout line starting with `prefix` (earlier lines are skipped)."""
    if not hasattr(proc, "lines"):
        proc.lines = queue.SimpleQueue()
        threading.Thread(target=lambda: [proc.lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no line starting {prefix!r} within {timeout} s") from None
        if line.startswith(prefix):
            return line.strip()


def test_an_nccl_op_is_polled_often_enough_that_a_landed_room_is_heard_of_at_once(monkeypatch):
    """The decode worker learns that a room's NCCL receive landed only when the pair's reaper polls its event: the
    pauses between polls grow from 50 us but stay at NCCL_POLL_MAX_S (a fraction of a room's copy on NVLink), so
    a room is never confirmed much later than it landed."""
    pauses = []

    class Clock:  # collective_pair's view of time: the pauses recorded, none slept
        monotonic = staticmethod(time.monotonic)
        sleep = staticmethod(pauses.append)

    class Op:  # an op's CUDA event that completes at its 40th query
        queries = 0

        def query(self):
            self.queries += 1
            return self.queries >= 40

    monkeypatch.setattr(collective_pair, "time", Clock)
    assert collective_pair.NcclBackend().wait(Op(), op_timeout_s=60, closed=lambda: False) is None
    assert len(pauses) == 39 and pauses[0] == 5e-5 and max(pauses) <= collective_pair.NCCL_POLL_MAX_S <= 2e-4
