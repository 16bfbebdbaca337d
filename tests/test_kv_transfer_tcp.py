"""The TCP KV transport over real sockets on 127.0.0.1 (ephemeral ports) and a real killed sender process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from pdserve.kv_cache import CacheConfig, LatentKVPool
from pdserve.kv_transfer import (
    TRANSPORTS, KVLayout, KVTransferError, TcpKVReceiver, TcpKVSender, TransferState, TransferStatus, page_runs,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE, LAYERS, KV_DIM, TOKENS = 4, 3, 24, 37


def make_layout(dtype: str = "float32", page_size: int = PAGE) -> KVLayout:
    return KVLayout("tiny-dsv3@abc123", page_size, LAYERS, KV_DIM, dtype)


class Recorder:
    """The decode engine's side of the callbacks: records everything, thread-safe."""

    def __init__(self):
        self.cv = threading.Condition()
        self.layers: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self.done: list[tuple[int, dict]] = []
        self.failed: list[tuple[int, KVTransferError, float]] = []

    def on_layer(self, room, layer, slots, values):
        with self.cv:
            self.layers.append((room, layer, slots, values))
            self.cv.notify_all()

    def on_done(self, room, aux):
        with self.cv:
            self.done.append((room, aux))
            self.cv.notify_all()

    def on_failed(self, room, error):
        with self.cv:
            self.failed.append((room, error, time.monotonic()))
            self.cv.notify_all()

    def wait_for(self, predicate, timeout: float = 5.0) -> None:
        with self.cv:
            assert self.cv.wait_for(predicate, timeout), f"timed out; layers={len(self.layers)} " \
                                                         f"done={self.done} failed={self.failed}"


def start_receiver(cleanup, layout, **kw) -> tuple[TcpKVReceiver, Recorder]:
    rec = Recorder()
    receiver = TcpKVReceiver(layout, on_layer=rec.on_layer, on_done=rec.on_done, on_failed=rec.on_failed, **kw)
    cleanup(receiver)
    return receiver, rec


def start_sender(cleanup, layout, **kw) -> TcpKVSender:
    sender = TcpKVSender(layout, **kw)
    cleanup(sender)
    return sender


def expected_slots(pages, num_tokens, page_size):
    return [pages[t // page_size] * page_size + t % page_size for t in range(num_tokens)]


def test_layout_mismatch_names_every_differing_field():
    a, b = make_layout(), make_layout(page_size=16)
    assert a.mismatch(a) is None
    msg = b.mismatch(a)
    assert msg == "page_size: prefill 16 vs decode 4"
    msg = KVLayout("other-model", 16, LAYERS, KV_DIM, "bfloat16").mismatch(a)
    for part in ("model_fingerprint", "'other-model'", "page_size: prefill 16 vs decode 4", "dtype", "bfloat16"):
        assert part in msg
    assert "kv_dim" not in msg and "num_kv_layers" not in msg
    assert KVLayout.from_dict(b.to_dict()) == b
    with pytest.raises(ValueError, match="dtype"):
        make_layout(dtype="float33")
    assert TRANSPORTS.get("tcp").receiver is TcpKVReceiver and "tcp" in TRANSPORTS.names()


@pytest.mark.parametrize("src, dst, num_tokens, page_size, num_runs", [
    ([0, 1, 2, 3], [4, 5, 6, 7], 16, 4, 1),  # contiguous on both sides
    ([3, 4, 9, 10, 11, 2], [0, 1, 2, 7, 8, 5], 24, 4, 4),  # scattered; runs break where either side jumps
    ([5, 6, 7], [1, 2, 3], 9, 4, 1),  # partial last page, contiguous
    ([2, 0, 1], [8, 3, 4, 9], 10, 4, 2),  # partial last page, scattered, spare destination page
    ([7], [3], 1, 16, 1),
])
def test_page_runs_cover_every_token_exactly(src, dst, num_tokens, page_size, num_runs):
    runs = page_runs(src, dst, num_tokens, page_size)
    assert len(runs) == num_runs
    mapping = {}
    for s, d, n in runs:
        for k in range(n):
            assert s + k not in mapping, "a source slot is covered twice"
            mapping[s + k] = d + k
    want = dict(zip(expected_slots(src, num_tokens, page_size), expected_slots(dst, num_tokens, page_size)))
    assert mapping == want
    with pytest.raises(ValueError):
        page_runs(src, dst, len(src) * page_size + 1, page_size)  # one page short


def fill_prefill_pool(dtype: torch.dtype, src_pages: list[int]) -> LatentKVPool:
    pool = LatentKVPool(LAYERS, KV_DIM, CacheConfig(page_size=PAGE, num_pages=16), dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape).to(dtype))
    return pool


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_into_scattered_pages(cleanup, dtype):
    layout = make_layout(dtype)
    torch_dtype = layout.torch_dtype
    receiver, rec = start_receiver(cleanup, layout)
    sender = start_sender(cleanup, layout)
    src_pages, dst_pages = [4, 5, 6, 0, 1, 12, 13, 14, 2, 3], [9, 2, 5, 6, 7, 0, 13, 11, 12, 3]
    prefill = fill_prefill_pool(torch_dtype, src_pages)
    decode = LatentKVPool(LAYERS, KV_DIM, CacheConfig(page_size=PAGE, num_pages=16), dtype=torch_dtype)
    hidden, rng = torch.randn(7, dtype=torch.bfloat16), os.urandom(100) + b"\x00end"

    receiver.expect(42, TOKENS, dst_pages, LAYERS)
    assert receiver.num_pending == 1
    handle = sender.begin(receiver.endpoint, 42, LAYERS)
    for layer in range(LAYERS):
        handle.send_layer(layer, prefill.gather(layer, src_pages, TOKENS))
    handle.finish({"first_token_id": 1234, "cached_tokens": 8, "hidden": hidden, "rng_state": rng})
    stats = handle.wait(timeout=5)
    assert handle.poll() == TransferState.DONE
    payload = LAYERS * TOKENS * KV_DIM * torch_dtype.itemsize
    assert payload < stats.bytes_sent < payload + 2000 and stats.seconds > 0

    rec.wait_for(lambda: rec.done)
    assert [layer for room, layer, _, _ in rec.layers] == [0, 1, 2] and {r for r, *_ in rec.layers} == {42}
    for _, layer, slots, values in rec.layers:
        assert slots.tolist() == expected_slots(dst_pages, TOKENS, PAGE)
        assert values.dtype == torch_dtype and values.shape == (TOKENS, KV_DIM)
        sent = prefill.gather(layer, src_pages, TOKENS)
        assert torch.equal(values.view(torch.uint8), sent.view(torch.uint8)), "rows are not bit-identical"
        decode.write(layer, slots, values)
        assert torch.equal(decode.gather(layer, dst_pages, TOKENS), sent)
    (room, aux), = rec.done
    assert room == 42 and aux["first_token_id"] == 1234 and aux["cached_tokens"] == 8
    assert aux["hidden"].dtype == torch.bfloat16 and torch.equal(aux["hidden"], hidden)
    assert aux["rng_state"] == rng
    time.sleep(0.1)
    assert len(rec.done) == 1 and not rec.failed and receiver.num_pending == 0


def test_rows_land_in_the_decode_pool_when_the_receiver_has_it(cleanup):
    """With kv_buffer (as the decode worker runs it) the receiver's thread writes each layer into the room's pages,
    gathered once on the sending side from the prefill pool's slots; on_layer only counts (values None)."""
    layout = make_layout("bfloat16")
    decode = LatentKVPool(LAYERS, KV_DIM, CacheConfig(page_size=PAGE, num_pages=16), dtype=torch.bfloat16)
    receiver, rec = start_receiver(cleanup, layout, kv_buffer=decode.kv)
    sender = start_sender(cleanup, layout)
    src_pages, dst_pages = [4, 5, 6, 0, 1, 12, 13, 14, 2, 3], [9, 2, 5, 6, 7, 0, 13, 11, 12, 3]
    prefill = fill_prefill_pool(torch.bfloat16, src_pages)
    receiver.expect(7, TOKENS, dst_pages, LAYERS)
    handle = sender.begin(receiver.endpoint, 7, LAYERS)
    for layer in range(LAYERS):
        handle.send_rows(layer, prefill.kv[layer], prefill.slots_for(src_pages, 0, TOKENS))
    handle.finish({"first_token_id": 1, "cached_tokens": 0, "hidden": None, "rng_state": b""})
    handle.wait(timeout=5)
    rec.wait_for(lambda: rec.done)
    assert [values for *_, values in rec.layers] == [None] * LAYERS
    for layer in range(LAYERS):
        assert torch.equal(decode.gather(layer, dst_pages, TOKENS), prefill.gather(layer, src_pages, TOKENS))
    untouched = torch.ones(decode.kv.shape[1], dtype=torch.bool)
    untouched[decode.slots_for(dst_pages, 0, TOKENS)] = False
    assert (decode.kv[:, untouched] == 0).all(), "a write outside the room's slots"


def test_two_rooms_interleaved_on_one_connection(cleanup):
    layout = make_layout()
    receiver, rec = start_receiver(cleanup, layout)
    sender = start_sender(cleanup, layout)
    rows = {room: torch.randn(LAYERS, n, KV_DIM) for room, n in ((1, 5), (2**64 - 1, 13))}
    pages = {1: [3, 1], 2**64 - 1: [0, 7, 2, 9]}
    handles = {}
    for room, r in rows.items():
        receiver.expect(room, r.shape[1], pages[room], LAYERS)
        handles[room] = sender.begin(receiver.endpoint, room, LAYERS)
    for layer in range(LAYERS):
        for room, h in handles.items():
            h.send_layer(layer, rows[room][layer])
    for room, h in handles.items():
        h.finish({"first_token_id": room % 1000, "cached_tokens": 0, "hidden": None, "rng_state": b""})
    for h in handles.values():
        h.wait(timeout=5)
    assert len(sender._conns) == 1  # one connection per endpoint, shared by both rooms
    rec.wait_for(lambda: len(rec.done) == 2)
    for room, layer, slots, values in rec.layers:
        assert torch.equal(values, rows[room][layer])
        assert slots.tolist() == expected_slots(pages[room], rows[room].shape[1], PAGE)
    assert {room: aux["first_token_id"] for room, aux in rec.done} == {1: 1, 2**64 - 1: (2**64 - 1) % 1000}
    assert all(aux["hidden"] is None and aux["rng_state"] == b"" for _, aux in rec.done)


def test_begin_if_paired_opens_a_room_only_on_a_live_pairing_and_never_connects(cleanup):
    layout = make_layout()
    receiver, rec = start_receiver(cleanup, layout)
    sender = start_sender(cleanup, layout)
    assert sender.begin_if_paired(receiver.endpoint, 1, LAYERS) is None  # not paired yet: no connection made
    assert sender._conns == {}
    receiver.expect(1, 3, [0], LAYERS)
    sender.begin(receiver.endpoint, 1, LAYERS).abort()  # pairs
    receiver.expect(2, 5, [4, 6], LAYERS)
    h = sender.begin_if_paired(receiver.endpoint, 2, LAYERS)
    assert h is not None and len(sender._conns) == 1
    for layer in range(LAYERS):
        h.send_layer(layer, torch.full((5, KV_DIM), float(layer)))
    h.finish({"first_token_id": 7, "cached_tokens": 0})
    h.wait(timeout=5)
    rec.wait_for(lambda: [room for room, _ in rec.done] == [2])
    with pytest.raises(ValueError, match="num_layers"):  # argument mistakes raise as begin's do
        sender.begin_if_paired(receiver.endpoint, 3, LAYERS + 1)
    receiver.close()  # the pairing breaks: nothing to open a room on without connecting again
    deadline = time.monotonic() + 5
    while next(iter(sender._conns.values())).broken is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.begin_if_paired(receiver.endpoint, 3, LAYERS) is None


def test_handshake_refuses_other_page_size_promptly(cleanup):
    receiver, rec = start_receiver(cleanup, make_layout(page_size=4))
    sender = start_sender(cleanup, make_layout(page_size=16))
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as err:
        sender.begin(receiver.endpoint, 5, LAYERS)
    assert time.monotonic() - t0 < 2.0
    assert err.value.kind == "incompatible"
    assert "page_size" in str(err.value) and "prefill 16 vs decode 4" in str(err.value)
    # the receiver is unharmed: a matching sender still gets through
    good = start_sender(cleanup, make_layout(page_size=4))
    receiver.expect(5, 2, [0], LAYERS)
    h = good.begin(receiver.endpoint, 5, LAYERS)
    for layer in range(LAYERS):
        h.send_layer(layer, torch.zeros(2, KV_DIM))
    h.finish({"first_token_id": 0, "cached_tokens": 0})
    h.wait(timeout=5)


def test_unreachable_endpoint_fails_promptly(cleanup):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = start_sender(cleanup, make_layout())
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as err:
        sender.begin(f"127.0.0.1:{port}", 1, LAYERS)
    assert err.value.kind == "unreachable" and f"127.0.0.1:{port}" in str(err.value)
    assert time.monotonic() - t0 < 2.0


def test_receiver_times_out_a_room_that_never_arrives(cleanup):
    layout = make_layout()
    receiver, rec = start_receiver(cleanup, layout, timeout_s=0.5)
    t0 = time.monotonic()
    receiver.expect(9, 3, [1], LAYERS)
    rec.wait_for(lambda: rec.failed, timeout=3.0)
    (room, error, t_failed), = rec.failed
    assert room == 9 and error.kind == "timeout" and "0/3 layers" in str(error)
    assert 0.45 <= t_failed - t0 <= 1.5
    assert receiver.num_pending == 0
    # a late sender is told why instead of hanging; on_failed is not called again
    h = start_sender(cleanup, layout).begin(receiver.endpoint, 9, LAYERS)
    h.send_layer(0, torch.zeros(3, KV_DIM))
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=3)
    assert err.value.kind == "timeout"
    assert len(rec.failed) == 1 and not rec.layers and not rec.done


def test_unknown_room_is_an_error_not_a_hang(cleanup):
    receiver, rec = start_receiver(cleanup, make_layout())
    h = start_sender(cleanup, make_layout()).begin(receiver.endpoint, 77, LAYERS)
    h.send_layer(0, torch.zeros(3, KV_DIM))
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=3)
    assert err.value.kind == "protocol" and "not expected" in str(err.value)
    assert not rec.layers


def test_decode_cancel_mid_transfer_stops_the_sender(cleanup):
    layout = make_layout()
    receiver, rec = start_receiver(cleanup, layout)
    receiver.expect(3, 6, [2, 5], LAYERS)
    h = start_sender(cleanup, layout).begin(receiver.endpoint, 3, LAYERS)
    h.send_layer(0, torch.ones(6, KV_DIM))
    rec.wait_for(lambda: rec.layers)
    assert receiver.cancel(3) is True
    assert receiver.cancel(3) is False  # already dropped: the caller freed the pages once
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as err:  # told at once, even though it has nothing more to send yet
        h.wait(timeout=3)
    assert err.value.kind == "aborted" and time.monotonic() - t0 < 1.0
    h.send_layer(1, torch.ones(6, KV_DIM))  # never raises; the outcome comes from wait()
    h.send_layer(2, torch.ones(6, KV_DIM))
    h.finish({"first_token_id": 0, "cached_tokens": 0})
    time.sleep(0.2)
    assert [layer for _, layer, _, _ in rec.layers] == [0]
    assert not rec.done and not rec.failed and receiver.num_pending == 0


def test_frames_for_a_cancelled_room_are_discarded_and_answered(cleanup):
    layout = make_layout()
    receiver, rec = start_receiver(cleanup, layout)
    receiver.expect(4, 6, [2, 5], LAYERS)
    assert receiver.cancel(4) is True  # before prefill sent anything: no connection to tell yet
    h = start_sender(cleanup, layout).begin(receiver.endpoint, 4, LAYERS)
    h.send_layer(0, torch.ones(6, KV_DIM))
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=3)
    assert err.value.kind == "aborted" and "cancelled" in str(err.value)
    assert not rec.layers and not rec.done and not rec.failed


def test_prefill_abort_releases_the_room_on_decode(cleanup):
    layout = make_layout()
    receiver, rec = start_receiver(cleanup, layout)
    receiver.expect(11, 6, [2, 5], LAYERS)
    h = start_sender(cleanup, layout).begin(receiver.endpoint, 11, LAYERS)
    h.send_layer(0, torch.ones(6, KV_DIM))
    h.abort()
    rec.wait_for(lambda: rec.failed, timeout=3.0)
    assert rec.failed[0][0] == 11 and rec.failed[0][1].kind == "aborted"
    with pytest.raises(KVTransferError, match="aborted"):
        h.wait(timeout=1)
    assert receiver.num_pending == 0


def test_decode_closed_mid_transfer_fails_the_sender(cleanup):
    layout = make_layout()
    receiver, rec = start_receiver(cleanup, layout)
    receiver.expect(12, 6, [2, 5], LAYERS)
    h = start_sender(cleanup, layout).begin(receiver.endpoint, 12, LAYERS)
    h.send_layer(0, torch.ones(6, KV_DIM))
    rec.wait_for(lambda: rec.layers)
    receiver.close()
    assert rec.failed[0][0] == 12 and rec.failed[0][1].kind == "aborted"
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=3)
    assert err.value.kind == "peer_failed"


def test_a_stalled_notifier_holds_up_no_transfer(cleanup):
    """A transfer's answers (ROOM_DONE; cuda_ipc's GRANT) leave from its connection's own thread: the notifier thread,
    held up writing to a peer that stopped reading, delays no other pairing's rooms."""
    layout = make_layout()
    receiver, rec = start_receiver(cleanup, layout)
    unblock = threading.Event()

    class StalledPeer:  # writing to it blocks, as to a socket whose peer no longer reads
        def send(self, header):
            unblock.wait(10)

    receiver._outbox.put((StalledPeer(), {"kind": "ROOM_FAILED", "room": 0}))
    try:
        receiver.expect(1, 5, [0, 1], LAYERS)
        h = start_sender(cleanup, layout).begin(receiver.endpoint, 1, LAYERS)
        for layer in range(LAYERS):
            h.send_layer(layer, torch.ones(5, KV_DIM))
        h.finish({"first_token_id": 1, "cached_tokens": 0})
        h.wait(timeout=3)
        rec.wait_for(lambda: rec.done)
    finally:
        unblock.set()


SENDER_SCRIPT = """
import json, sys, time, torch
from pdserve.kv_transfer import KVLayout, TcpKVSender
layout = KVLayout(**json.loads(sys.argv[1]))
handle = TcpKVSender(layout).begin(sys.argv[2], int(sys.argv[3]), layout.num_kv_layers)
handle.send_layer(0, torch.ones(int(sys.argv[4]), layout.kv_dim))
time.sleep(60)
"""


def test_sender_process_killed_mid_transfer_fails_the_room(cleanup):
    layout = make_layout()
    receiver, rec = start_receiver(cleanup, layout)
    receiver.expect(21, 5, [1, 4], LAYERS)
    proc = subprocess.Popen([sys.executable, "-c", SENDER_SCRIPT, json.dumps(layout.to_dict()), receiver.endpoint,
                             "21", "5"], cwd=REPO)
    try:
        rec.wait_for(lambda: rec.layers, timeout=15.0)  # the child imports torch first
        assert not rec.failed
        proc.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        rec.wait_for(lambda: rec.failed, timeout=2.0)
    finally:
        proc.kill()
        proc.wait()
    (room, error, t_failed), = rec.failed
    assert room == 21 and error.kind == "peer_failed" and "1/3 layers" in str(error)
    assert t_failed - t_kill < 2.0 and receiver.num_pending == 0


def test_transfer_state_moves_forward_and_failure_overrides():
    s = TransferStatus()
    assert s.state == TransferState.BOOTSTRAPPING
    assert s.advance(TransferState.WAITING_FOR_DEST) and s.advance(TransferState.TRANSFERRING)
    assert not s.advance(TransferState.TRANSFERRING)  # same state: no-op
    with pytest.raises(AssertionError):
        s.advance(TransferState.WAITING_FOR_DEST)
    assert s.fail("peer_failed", "gone") and s.state == TransferState.FAILED
    assert not s.fail("timeout", "late") and s.error_kind == "peer_failed" and s.error == "gone"
    assert not s.advance(TransferState.DONE) and s.state == TransferState.FAILED  # FAILED is terminal
    assert s.exception().kind == "peer_failed"

    d = TransferStatus(TransferState.TRANSFERRING)
    assert d.advance(TransferState.DONE)
    assert not d.fail("aborted", "too late") and d.state == TransferState.DONE and d.error is None
    with pytest.raises(AssertionError):
        d.advance(TransferState.TRANSFERRING)
