"""The NIXL KV transport with the real library (UCX over DRAM on the CPU): rows WRITTEN by the prefill side straight
into the decode pool's pages (or into its staging area and scattered, for scattered pages), control over real
sockets, faults with real processes (a prefill or decode process SIGKILLed mid-transfer), the UCX transport read from
a separate sender process. NIXL is a test extra: these tests run, they never skip."""

from __future__ import annotations

import base64
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

from pdserve.kv_transfer import (
    TRANSPORTS, KVTransferError, NixlKVReceiver, NixlKVSender, TransferState, page_runs, token_slots,
)
from pdserve.kv_transfer.nixl_agent import Arena, NixlAgent, NixlUnavailable, load_api
from pdserve.kv_transfer.nixl_receiver import MAX_DIRECT_RUNS
from pdserve.kv_transfer.nixl_sender import parse_hello_ok
from pdserve.kv_transfer.wire import HELLO_OK, recv_frame, send_frame

from stack import free_port
from test_kv_transfer_collective import AUX, NUM_PAGES, Decode, read_line, wait_until
from test_kv_transfer_tcp import KV_DIM, LAYERS, PAGE, TOKENS, Recorder, make_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCATTERED = [9, 2, 5, 7, 0, 13, 11, 15, 3, 1]  # 37 tokens over 10 pages: 10 runs, a partial last page
STAGING = LAYERS * TOKENS * KV_DIM * 4 * 2  # room for two float32 rooms of TOKENS tokens in the staging area


def nixl_decode(cleanup, layout=None, staging_bytes=STAGING, **options) -> Decode:
    return Decode(cleanup, layout, transport="nixl", staging_bytes=staging_bytes, **options)


def nixl_sender(cleanup, layout=None, **options) -> NixlKVSender:
    s = NixlKVSender(layout or make_layout(), **options)
    cleanup(s)
    return s


def rows_of(room: int, layout=None) -> torch.Tensor:
    dtype = (layout or make_layout()).torch_dtype
    return torch.randn(LAYERS, TOKENS, KV_DIM, generator=torch.Generator().manual_seed(room)).to(dtype)  # (L, T, D)


def send(s, decode: Decode, room: int, pages=None, layers=range(LAYERS), finish=True):
    pages = decode.reserve(room, TOKENS, pages)
    h = s.begin(decode.receiver.endpoint, room, LAYERS, dst_pages=pages)
    for layer in layers:
        h.send_layer(layer, rows_of(room, decode.layout)[layer])
    if finish:
        h.finish(AUX)
    return h, pages


def landed(decode: Decode, room: int, pages) -> bool:
    slots = token_slots(pages, TOKENS, PAGE)
    return torch.equal(decode.pool.kv[:, slots].view(torch.uint8), rows_of(room, decode.layout).view(torch.uint8))


def grants(decode: Decode) -> list:
    """The GRANT answers the decode worker sends from now on."""
    seen = []
    reply = decode.receiver.reply
    decode.receiver.reply = lambda peer, header: (header["kind"] == "GRANT" and seen.append(header),
                                                  reply(peer, header))
    return seen


def test_nixl_is_installed_and_registered():
    load_api()  # a test extra: missing, this fails (it never skips)
    assert TRANSPORTS.get("nixl").sender is NixlKVSender and TRANSPORTS.get("nixl").devices == ("cpu", "cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pages, staging_bytes, staged", [
    ("contiguous", STAGING, False),  # one run: a descriptor per layer
    ("few runs", STAGING, False),  # MAX_DIRECT_RUNS runs at most: in place
    ("scattered", STAGING, True),  # more runs: one WRITE per layer into staging, scattered on arrival
    ("scattered", 0, False),  # no staging area: in place all the same, a descriptor per layer and run
])
def test_rows_land_bit_identical_in_the_pages(cleanup, dtype, pages, staging_bytes, staged):
    layout = make_layout(dtype)
    decode = nixl_decode(cleanup, layout, staging_bytes=staging_bytes)
    s = nixl_sender(cleanup, layout)
    seen = grants(decode)
    decode.pool.allocator.alloc(NUM_PAGES)  # the test hands out its own pages
    dst = {"contiguous": list(range(3, 13)), "few runs": [0, 1, 3, 4, 6, 8, 10, 12, 14, 2],
           "scattered": SCATTERED}[pages]
    assert len(page_runs(range(10), dst, TOKENS, PAGE)) == {"contiguous": 1, "few runs": MAX_DIRECT_RUNS,
                                                            "scattered": 10}[pages]
    h, _ = send(s, decode, 42, dst)
    stats = h.wait(timeout=10)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert [g["staging"] is not None for g in seen] == [staged] and h.transport == "nixl"
    assert h.link and h.link != "unknown"  # UCX's pick, read from its tables (also with several agents in a process)
    assert stats.bytes_sent >= rows_of(42, layout).numel() * rows_of(42, layout).element_size()
    assert [(room, layer) for room, layer, _, _ in decode.rec.layers] == [(42, 0), (42, 1), (42, 2)]
    assert all(values is None for *_, values in decode.rec.layers)
    assert landed(decode, 42, dst)
    untouched = torch.ones(decode.pool.kv.shape[1], dtype=torch.bool)
    untouched[token_slots(dst, TOKENS, PAGE)] = False
    assert (decode.pool.kv[:, untouched] == -1).all(), "a slot outside the room's pages was written"
    assert not decode.rec.failed
    if staged:  # every staging block went back once its room was in
        assert decode.receiver.plane.staging.free_bytes == staging_bytes


def test_layers_land_as_their_writes_complete_before_the_aux(cleanup):
    """Layer-wise: each send is one WRITE and one announcement, and the decode worker hears of a layer while the
    prompt's later layers are still being computed; a run of layers (send_layers, gathered from the prefill pool by
    slot) is one WRITE too. The send that completes the room is announced by the AUX frame that follows it."""
    decode = nixl_decode(cleanup)
    s = nixl_sender(cleanup)
    frames = decode.record_frames()
    prefill_pool = torch.randn(LAYERS, 64, KV_DIM)  # (layers, slots, kv_dim)
    src_slots = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:TOKENS]
    pages = decode.reserve(7, TOKENS)
    h = s.begin(decode.receiver.endpoint, 7, LAYERS, dst_pages=pages)
    assert h.streams_layers is True
    h.send_rows(0, prefill_pool[0], src_slots)
    decode.rec.wait_for(lambda: decode.rec.layers)  # landed before the next layer was even sent
    h.send_layers(1, prefill_pool[1:], src_slots)  # the room's last layers: its AUX announces them
    assert not decode.rec.done, "AUX not sent yet: the room is not done"
    h.finish(AUX)
    h.wait(timeout=10)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert [f for f in frames if f[0] in ("LAYER", "AUX")] == [("LAYER", 0), ("AUX", [1, 2])]
    assert [(room, layer) for room, layer, _, _ in decode.rec.layers] == [(7, layer) for layer in range(LAYERS)]
    slots = token_slots(pages, TOKENS, PAGE)
    for layer in range(LAYERS):
        assert torch.equal(decode.pool.kv[layer, slots], prefill_pool[layer, src_slots])


def test_interleaved_rooms_share_one_pairing_and_the_arenas_empty(cleanup):
    decode = nixl_decode(cleanup, num_pages=64)
    s = nixl_sender(cleanup)
    handles = {}
    for room in (1, 2**64 - 1, 5):
        pages = decode.reserve(room, TOKENS)
        handles[room] = (s.begin(decode.receiver.endpoint, room, LAYERS, dst_pages=pages), pages)
    for layer in range(LAYERS):
        for room, (h, _) in handles.items():
            h.send_layer(layer, rows_of(room)[layer])
    for h, _ in handles.values():
        h.finish(AUX)
    for h, _ in handles.values():
        h.wait(timeout=10)
    assert len(s._conns) == 1, "the rooms go over one connection and one NIXL peer"
    decode.rec.wait_for(lambda: len(decode.rec.done) == 3)
    assert all(landed(decode, room, pages) for room, (_, pages) in handles.items())
    arena = s.pairing.arena()
    del h, handles
    wait_until(lambda: arena.free_bytes == arena.nbytes)  # every block went back after its WRITE
    assert decode.idle


def test_rows_gathered_outside_a_full_arena_do_not_wait_for_room_someone_else_holds(cleanup):
    """The arena's room may be held by a send queued behind this one (gathered on the caller's thread while this one
    waited) or by another connection's: rows gathered outside it are registered by themselves rather than wait for
    it (which would wait until the transfer's deadline)."""
    decode = nixl_decode(cleanup)
    s = nixl_sender(cleanup, arena_bytes=KV_DIM * 4 * TOKENS + 256, timeout_s=30)
    pages = decode.reserve(4, TOKENS)
    h = s.begin(decode.receiver.endpoint, 4, LAYERS, dst_pages=pages)
    arena = s.pairing.arena()
    held = arena.take(arena.free_bytes // arena.ALIGN * arena.ALIGN)  # a later send's gather, held until written
    assert held is not None and arena.free_bytes < KV_DIM * 4 * TOKENS
    for layer in range(LAYERS):
        h.send_layer(layer, rows_of(4, decode.layout)[layer])
    h.finish(AUX)
    h.wait(timeout=5)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert landed(decode, 4, pages) and decode.idle
    del held, h
    wait_until(lambda: arena.free_bytes == arena.nbytes)


@pytest.mark.parametrize("arena_bytes", [
    KV_DIM * 4 * TOKENS + 256,  # one layer's rows fit: the others move in as WRITEs free it, or by themselves
    1024,  # not even one layer fits: each send's rows are registered for their one WRITE
])
def test_rows_beyond_the_arena_still_land(cleanup, arena_bytes):
    decode = nixl_decode(cleanup)
    s = nixl_sender(cleanup, arena_bytes=arena_bytes)
    h, pages = send(s, decode, 3)
    h.wait(timeout=10)
    decode.rec.wait_for(lambda: decode.rec.done)
    assert landed(decode, 3, pages) and decode.idle
    arena = s.pairing.arena()
    del h
    wait_until(lambda: arena.free_bytes == arena.nbytes)
    assert s.pairing.agent._registrations.keys() == {arena.registered.addr, s.pairing._probe.addr}, \
        "a WRITE's own registration stayed"


def test_a_run_of_layers_larger_than_half_the_arena_goes_as_several_writes(cleanup):
    """A whole prompt handed over at once (send_layers, e.g. a prompt bound after its forward) whose rows exceed half
    the send arena: one WRITE and one announcement per piece that fits, so the arena bounds the memory in transit.
    The WRITEs are in flight together as far as the arena holds their rows (two pieces here): the next is posted
    before the first is polled, so they overlap rather than take turns. The send completes the room, so the AUX frame
    after every WRITE announces all its pieces at once."""
    decode = nixl_decode(cleanup)
    s = nixl_sender(cleanup, arena_bytes=2 * TOKENS * KV_DIM * 4 + 256)  # half of it: one layer's rows
    send(s, decode, 3)[0].wait(timeout=10)  # pairs
    calls, agent = [], s.pairing.agent
    write, state = agent.write, agent.state
    agent.write = lambda *a: (calls.append("write"), write(*a))[1]
    agent.state = lambda xfer: (calls.append("poll"), state(xfer))[1]
    frames = decode.record_frames()
    pages = decode.reserve(4, TOKENS)
    h = s.begin(decode.receiver.endpoint, 4, LAYERS, dst_pages=pages)
    h.send_layers(0, rows_of(4))
    h.finish(AUX)
    h.wait(timeout=10)
    decode.rec.wait_for(lambda: len(decode.rec.done) == 2)
    assert [f for f in frames if f[0] in ("LAYER", "AUX")] == [("AUX", list(range(LAYERS)))]
    assert landed(decode, 4, pages)
    assert calls[:2] == ["write", "write"] and calls.count("write") == LAYERS, calls[:8]


def test_the_arena_hands_out_disjoint_blocks_and_merges_them_back():
    agent = NixlAgent("pdserve-test-arena")
    try:
        arena = Arena(agent, 4096, "cpu")
        blocks = [arena.take(1000) for _ in range(4)]  # 1024 each (aligned)
        assert [b.offset for b in blocks] == [0, 1024, 2048, 3072] and arena.take(1) is None
        blocks[1] = blocks[2] = None  # given back when dropped: the two merge
        big = arena.take(2048)
        assert big.offset == 1024 and arena.free_bytes == 0
        big.view((2, 256), torch.float32).fill_(1.0)
        with pytest.raises(AssertionError, match="does not fit"):
            big.view((2, 257), torch.float32)
        del big, blocks
        assert arena.free_bytes == 4096 and arena.take(4096).offset == 0
    finally:
        agent.close()


# ---- the handshake -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefill, decode", [("nixl", "tcp"), ("tcp", "nixl"), ("gloo", "nixl")])
def test_other_transports_are_refused_at_the_handshake(cleanup, prefill, decode):
    layout = make_layout()
    rec = Recorder()
    kv = torch.zeros(LAYERS, NUM_PAGES * PAGE, KV_DIM)
    receiver = TRANSPORTS.get(decode).receiver(layout, on_layer=rec.on_layer, on_done=rec.on_done,
                                               on_failed=rec.on_failed, kv_buffer=kv)
    cleanup(receiver)
    s = TRANSPORTS.get(prefill).sender(layout)
    cleanup(s)
    with pytest.raises(KVTransferError) as err:
        s.begin(receiver.endpoint, 5, LAYERS, dst_pages=[0])
    assert err.value.kind == "incompatible" and f"prefill {prefill!r} vs decode {decode!r}" in str(err.value)


def test_a_wrong_token_or_layout_is_refused(cleanup):
    decode = nixl_decode(cleanup, token="secret")
    with pytest.raises(KVTransferError) as err:
        nixl_sender(cleanup, token="guess").begin(decode.receiver.endpoint, 1, LAYERS, dst_pages=[0])
    assert err.value.kind == "unauthenticated"
    with pytest.raises(KVTransferError) as err:
        nixl_sender(cleanup, make_layout(page_size=16), token="secret").begin(decode.receiver.endpoint, 1, LAYERS,
                                                                              dst_pages=[0])
    assert err.value.kind == "incompatible" and "page_size" in str(err.value)
    h, pages = send(nixl_sender(cleanup, token="secret"), decode, 2)  # the receiver is unharmed
    h.wait(timeout=10)
    assert landed(decode, 2, pages)


def fake_decode(hello_ok: dict) -> tuple[socket.socket, threading.Thread]:
    """A decode KV endpoint that answers any HELLO with `hello_ok`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            recv_frame(conn, 0)
            send_frame(conn, {"kind": HELLO_OK, **hello_ok})
            conn.recv(1)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return listener, t


GOOD_POOL = {"addr": 4096, "nbytes": LAYERS * 64 * KV_DIM * 4, "device": 0, "mem_type": "DRAM",
             "shape": [LAYERS, 64, KV_DIM], "dtype": "float32"}


@pytest.mark.parametrize("nixl, message", [
    (None, "agent metadata"),
    ({"agent": "not base64!", "pool": GOOD_POOL}, "base64"),
    ({"agent": "AAAA", "pool": {**GOOD_POOL, "shape": [LAYERS, 64, KV_DIM + 1]}}, "does not hold"),
    ({"agent": "AAAA", "pool": {**GOOD_POOL, "nbytes": 7}}, "is not 7 bytes"),
    ({"agent": "AAAA", "pool": {**GOOD_POOL, "mem_type": "FILE"}}, "malformed"),
    ({"agent": "AAAA", "pool": GOOD_POOL, "staging": {"addr": -1}}, "staging area"),
])
def test_a_malformed_hello_ok_is_a_protocol_error_before_nixl_sees_it(cleanup, nixl, message):
    with pytest.raises(ValueError, match=message):
        parse_hello_ok({"nixl": nixl}, make_layout())
    listener, t = fake_decode({"transport": "nixl", "nixl": nixl})
    with listener:
        with pytest.raises(KVTransferError) as err:
            nixl_sender(cleanup).begin(f"127.0.0.1:{listener.getsockname()[1]}", 1, LAYERS, dst_pages=[0])
    assert err.value.kind == "protocol" and message in str(err.value)


def test_metadata_of_no_agent_is_unreachable(cleanup):
    probe = {"addr": 4096, "nbytes": 256, "device": 0, "mem_type": "DRAM"}
    listener, t = fake_decode({"transport": "nixl", "nixl": {"agent": "AAAA", "pool": GOOD_POOL, "probe": probe}})
    with listener:
        with pytest.raises(KVTransferError) as err:
            nixl_sender(cleanup).begin(f"127.0.0.1:{listener.getsockname()[1]}", 1, LAYERS, dst_pages=[0])
    assert err.value.kind == "unreachable" and "NIXL" in str(err.value)


def test_a_pairing_whose_first_write_fails_is_unreachable(cleanup):
    """At pairing the sender WRITEs the decode worker's probe once: memory it cannot write (here: an address the
    decode agent never registered) fails the pairing, not the first room."""
    agent = NixlAgent("pdserve-test-decode")
    pool = torch.zeros(LAYERS, 64, KV_DIM)
    try:
        reg = agent.register(pool)
        nixl = {"agent": base64.b64encode(agent.metadata()).decode(),
                "pool": {**GOOD_POOL, "addr": reg.addr},
                "probe": {"addr": reg.addr + reg.nbytes + (1 << 20), "nbytes": 256, "device": 0, "mem_type": "DRAM"}}
        listener, t = fake_decode({"transport": "nixl", "nixl": nixl})
        with listener:
            with pytest.raises(KVTransferError) as err:
                nixl_sender(cleanup).begin(f"127.0.0.1:{listener.getsockname()[1]}", 1, LAYERS, dst_pages=[0])
        assert err.value.kind == "unreachable" and "a first NIXL WRITE into its memory" in str(err.value)
        assert (pool == 0).all()
    finally:
        agent.close()


def test_a_missing_nixl_names_the_extra_when_the_worker_starts(monkeypatch):
    def no_nixl(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr("importlib.import_module", no_nixl)
    rec = Recorder()
    with pytest.raises(NixlUnavailable, match=r"pip install 'pdserve\[nixl\]'"):
        NixlKVSender(make_layout())
    with pytest.raises(NixlUnavailable, match=r"pdserve\[nixl\]"):
        NixlKVReceiver(make_layout(), on_layer=rec.on_layer, on_done=rec.on_done, on_failed=rec.on_failed,
                       kv_buffer=torch.zeros(LAYERS, 64, KV_DIM))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_without_nixl_stops_before_loading_its_model_naming_the_extra(tmp_path, role):
    shadow = tmp_path / "nixl_cu13"  # an import of NIXL fails, as where it is not installed
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('NIXL is not installed here')\n")
    out = subprocess.run([sys.executable, "-m", "pdserve", role, "--kv-transport", "nixl", "--device", "cpu"],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"pdserve {role}: error: --kv-transport nixl needs NIXL, which is not installed: "
                                 "pip install 'pdserve[nixl]'") and out.stderr.count("\n") == 1, out.stderr
    assert "loaded shard" not in out.stderr + out.stdout


# ---- pages, deadlines, aborts ---------------------------------------------------------------------------------------

def test_pages_outside_the_pool_or_the_reservation_are_never_written(cleanup):
    decode = nixl_decode(cleanup, num_pages=32)
    s = nixl_sender(cleanup)
    decode.reserve(5, TOKENS)
    with pytest.raises(KVTransferError) as err:
        s.begin(decode.receiver.endpoint, 5, LAYERS, dst_pages=[0, 1, 2, 3, 4, 5, 6, 7, 8, 32 + 1])
    assert err.value.kind == "protocol" and "outside the decode pool" in str(err.value)
    pages = decode.reserve(6, TOKENS)
    h = s.begin(decode.receiver.endpoint, 6, LAYERS, dst_pages=[p + 1 for p in pages])  # inside, not this room's
    for layer in range(LAYERS):
        h.send_layer(layer, rows_of(6)[layer])
    h.finish(AUX)
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=10)
    assert err.value.kind == "protocol" and "reserved" in str(err.value)
    decode.rec.wait_for(lambda: len(decode.rec.failed) == 1)
    assert (decode.pool.kv == -1).all(), "rows were written without a grant"
    decode.cancel(5)
    assert decode.idle


@pytest.mark.parametrize("layers", [[0, 0], [1, LAYERS], [0, 2], "0"])
def test_a_bad_announcement_fails_only_its_room(cleanup, layers):
    decode = nixl_decode(cleanup)
    s = nixl_sender(cleanup)
    h, _ = send(s, decode, 8, layers=[], finish=False)
    assert h.plane_state.granted.wait(5)
    h._conn.queue.put((h, "LAYER", h._conn.frame(h, "LAYER", {"layers": layers, "num_tokens": TOKENS}), None))
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=10)
    assert err.value.kind == "protocol" and "bad LAYER announcement" in str(err.value)
    decode.rec.wait_for(lambda: decode.rec.failed)  # released on the sender's ABORT
    assert decode.idle
    h2, pages = send(s, decode, 9)  # the pairing goes on
    h2.wait(timeout=10)
    assert landed(decode, 9, pages)


@pytest.mark.parametrize("staged", [False, True])
def test_a_decode_timeout_holds_the_pages_until_the_sender_released_them(cleanup, staged):
    decode = nixl_decode(cleanup, timeout_s=0.6)
    s = nixl_sender(cleanup)
    pages = SCATTERED if staged else None
    if staged:
        decode.pool.allocator.alloc(decode.pool.allocator.num_free)
    h, pages = send(s, decode, 9, pages, layers=[0], finish=False)  # then prefill stalls
    decode.rec.wait_for(lambda: decode.rec.layers)
    t0 = time.monotonic()
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=3.0)
    (room, error, t_failed), = decode.rec.failed
    assert room == 9 and error.kind == "timeout" and "1/3 layers" in str(error) and t_failed - t0 < 1.0
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=3)
    assert err.value.kind == "timeout"
    h.send_layer(1, rows_of(9)[1])  # never raises; nothing is written for a failed room
    if staged:
        decode.pool.allocator.decref(list(set(range(NUM_PAGES)) - set(SCATTERED)))
    assert decode.idle
    conn = s._conns[decode.receiver.endpoint]
    h, pages = send(s, decode, 10)
    h.wait(timeout=10)
    assert s._conns[decode.receiver.endpoint] is conn, "a timed-out room does not cost the pairing"
    assert landed(decode, 10, pages)
    if staged:
        assert decode.receiver.plane.staging.free_bytes == STAGING


def test_decode_cancel_waits_for_the_senders_release_and_an_ungranted_one_frees_at_once(cleanup):
    decode = nixl_decode(cleanup)
    s = nixl_sender(cleanup)
    h, _ = send(s, decode, 11, layers=[0], finish=False)
    decode.rec.wait_for(lambda: decode.rec.layers)
    assert decode.cancel(11) is False, "the sender may be writing: the pages are freed on on_failed"
    decode.rec.wait_for(lambda: decode.rec.failed)  # after the sender's ABORT (its WRITEs resolved)
    assert decode.rec.failed[0][1].kind == "aborted" and decode.idle
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=5)
    assert err.value.kind == "aborted"
    decode.reserve(12, TOKENS)
    assert decode.cancel(12) is True and decode.idle  # never granted: nothing can be writing


def test_prefill_abort_and_sender_timeout_release_the_pages(cleanup):
    decode = nixl_decode(cleanup)
    s = nixl_sender(cleanup)
    h, _ = send(s, decode, 21, layers=[0], finish=False)
    h.abort()
    decode.rec.wait_for(lambda: decode.rec.failed)
    assert decode.rec.failed[0][1].kind == "aborted" and decode.idle
    h, _ = send(s, decode, 22, layers=[0, 1], finish=False)
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=0.3)  # the sender gives up: the decode worker is told at once
    assert err.value.kind == "timeout"
    decode.rec.wait_for(lambda: len(decode.rec.failed) == 2)
    assert decode.rec.failed[1][1].kind == "aborted" and decode.idle


def test_a_sender_that_never_releases_loses_its_pairing(cleanup):
    decode = nixl_decode(cleanup, drain_timeout_s=0.3)
    s = nixl_sender(cleanup)
    h, _ = send(s, decode, 31, layers=[0], finish=False)
    assert h.plane_state.granted.wait(5)
    h._fail = lambda *a, **kw: False  # fault: the sender ignores ROOM_FAILED and never answers ABORT
    assert decode.cancel(31) is False
    decode.rec.wait_for(lambda: decode.rec.failed, timeout=5)  # released when the pairing was closed
    assert decode.idle
    # The decode worker records the room's failure before the sender reads the close: a room sent in between would
    # go on the closing pairing and fail with it.
    wait_until(lambda: h._conn.broken is not None)
    h2, pages = send(s, decode, 32)  # the sender pairs again
    h2.wait(timeout=10)
    assert landed(decode, 32, pages)


def test_a_write_in_err_fails_the_room_peer_failed_and_the_next_room_pairs_again(cleanup):
    """NIXL reports a WRITE in ERR when the link under it failed: the pairing ends (its rooms fail peer_failed on
    both sides, the decode pages are released) and the next room makes a new one."""
    decode = nixl_decode(cleanup)
    s = nixl_sender(cleanup)
    send(s, decode, 1)[0].wait(timeout=10)  # pairs
    agent, state = s.pairing.agent, s.pairing.agent.state
    agent.state = lambda xfer: "ERR"  # fault: the link under the WRITEs fails
    h, _ = send(s, decode, 2)
    with pytest.raises(KVTransferError) as err:
        h.wait(timeout=10)
    assert err.value.kind == "peer_failed" and "NIXL WRITE" in str(err.value)
    decode.rec.wait_for(lambda: decode.rec.failed)
    (room, error, _), = decode.rec.failed
    assert room == 2 and error.kind == "peer_failed"
    agent.state = state
    h, pages = send(s, decode, 3)
    h.wait(timeout=10)
    assert landed(decode, 3, pages) and decode.idle


# ---- real processes ------------------------------------------------------------------------------------------------

SENDER_SCRIPT = """
import json, logging, sys, time, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from pdserve.kv_transfer import KVLayout, NixlKVSender
layout, pages, n = KVLayout(**json.loads(sys.argv[1])), json.loads(sys.argv[4]), int(sys.argv[5])
rows = torch.randn(layout.num_kv_layers, n, layout.kv_dim, generator=torch.Generator().manual_seed(int(sys.argv[3])))
sender = NixlKVSender(layout)
handle = sender.begin(sys.argv[2], int(sys.argv[3]), layout.num_kv_layers, dst_pages=pages)
handle.send_layer(0, rows[0])
if sys.argv[6] == "whole":
    for layer in range(1, layout.num_kv_layers):
        handle.send_layer(layer, rows[layer])
    handle.finish({"first_token_id": 7, "cached_tokens": 0})
    handle.wait(10)
    print("sent", handle.transport, sender.pairing.agent.transport(handle._conn.plane.peer), flush=True)
time.sleep(60)
"""


def start_sender(decode: Decode, room: int, pages, n: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SENDER_SCRIPT, json.dumps(decode.layout.to_dict()),
                             decode.receiver.endpoint, str(room), json.dumps(pages), str(n), mode], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_sender_process_writes_into_this_pool_and_names_the_ucx_transport(cleanup):
    """Two agents in two processes, as workers run them: the rows land, and UCX's pick for the WRITEs (on one host
    without GPUs, a shared-memory transport such as cma/memory) is read from UCX's own tables, logged at pairing."""
    decode = nixl_decode(cleanup)
    decode.pool.allocator.alloc(decode.pool.allocator.num_free)
    decode.reserve(51, TOKENS, SCATTERED)
    proc = start_sender(decode, 51, SCATTERED, TOKENS, "whole")
    try:
        line = read_line(proc, "sent", 30.0)
        decode.rec.wait_for(lambda: decode.rec.done)
    finally:
        proc.kill()
        _, err = proc.communicate()
    _, transport, ucx = line.split()
    assert transport == "nixl" and ucx not in ("unknown", "") and "/" in ucx, line
    assert f"over nixl (UCX: {ucx})" in err
    slots = token_slots(SCATTERED, TOKENS, PAGE)
    rows = torch.randn(LAYERS, TOKENS, KV_DIM, generator=torch.Generator().manual_seed(51))
    assert torch.equal(decode.pool.kv[:, slots], rows)


def test_prefill_killed_mid_transfer_frees_the_pages(cleanup):
    decode = nixl_decode(cleanup)
    pages = decode.reserve(61, 5)
    proc = start_sender(decode, 61, pages, 5, "stall")
    try:
        decode.rec.wait_for(lambda: decode.rec.layers, timeout=30.0)  # the child imports torch and NIXL first
        proc.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        decode.rec.wait_for(lambda: decode.rec.failed, timeout=3.0)
    finally:
        proc.kill()
        proc.wait()
    (room, error, t_failed), = decode.rec.failed
    assert room == 61 and error.kind == "peer_failed" and "1/3 layers" in str(error)
    assert t_failed - t_kill < 2.0 and decode.idle and decode.receiver.num_pending == 0
    h, pages = send(nixl_sender(cleanup), decode, 62)  # the next prefill worker pairs with the same receiver
    h.wait(timeout=10)
    assert landed(decode, 62, pages)


RECEIVER_SCRIPT = """
import json, sys, time, torch
from pdserve.kv_transfer import KVLayout, NixlKVReceiver
layout = KVLayout(**json.loads(sys.argv[1]))
say = lambda *words: print(*words, flush=True)
pool = torch.zeros(layout.num_kv_layers, 256, layout.kv_dim)
receiver = NixlKVReceiver(layout, port=int(sys.argv[2]), kv_buffer=pool,
                          on_layer=lambda room, layer, slots, values: say("layer", room, layer),
                          on_done=lambda room, aux: say("done", room), on_failed=lambda room, e: say("failed", room))
receiver.expect(int(sys.argv[3]), 6, [3, 4], layout.num_kv_layers)
say("ready", receiver.endpoint)
time.sleep(60)
"""


def test_decode_killed_mid_transfer_fails_the_room_and_a_restarted_one_pairs_again(cleanup):
    layout, port = make_layout(), free_port()
    start = lambda room: subprocess.Popen(  # noqa: E731
        [sys.executable, "-c", RECEIVER_SCRIPT, json.dumps(layout.to_dict()), str(port), str(room)], cwd=REPO,
        stdout=subprocess.PIPE, text=True)
    procs = [start(71)]
    try:
        endpoint = read_line(procs[0], "ready", 30.0).split()[1]
        s = nixl_sender(cleanup, layout)
        h = s.begin(endpoint, 71, LAYERS, dst_pages=[3, 4])
        h.send_layer(0, torch.ones(6, KV_DIM))
        read_line(procs[0], "layer 71 0", 10.0)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        t_kill = time.monotonic()
        h.send_layer(1, torch.ones(6, KV_DIM))  # never raises, never hangs: its WRITE fails or is never made
        with pytest.raises(KVTransferError) as err:
            h.wait(timeout=10)
        assert err.value.kind == "peer_failed" and time.monotonic() - t_kill < 2.0
        assert h.poll() == TransferState.FAILED
        procs.append(start(72))  # decode restarted on the same port: a new agent, a new pairing
        read_line(procs[1], "ready", 30.0)
        h = s.begin(endpoint, 72, LAYERS, dst_pages=[3, 4])
        for layer in range(LAYERS):
            h.send_layer(layer, torch.ones(6, KV_DIM))
        h.finish(AUX)
        h.wait(timeout=10)
        read_line(procs[1], "done 72", 10.0)
    finally:
        for p in procs:
            p.kill()
            p.wait()
