"""The TCP KV receiver against strangers and malicious peers (raw sockets after a valid HELLO), and KV checksums:
a bad frame fails its room and closes that connection; rooms of other connections complete intact."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from pdserve.kv_transfer import KVLayout, KVTransferError, TcpKVReceiver, TcpKVSender
from pdserve.kv_transfer import wire

PAGE, LAYERS, KV_DIM, TOKEN = 4, 3, 8, "s3cret"
LAYOUT = KVLayout("tiny@1", PAGE, LAYERS, KV_DIM, "float32")


class Recorder:
    def __init__(self):
        self.cv = threading.Condition()
        self.layers, self.done, self.failed = [], [], []

    def on_layer(self, room, layer, slots, values):
        with self.cv:
            self.layers.append((room, layer, slots.clone(), values.clone()))
            self.cv.notify_all()

    def on_done(self, room, aux):
        with self.cv:
            self.done.append((room, aux))
            self.cv.notify_all()

    def on_failed(self, room, error):
        with self.cv:
            self.failed.append((room, error))
            self.cv.notify_all()

    def wait_for(self, predicate, timeout=5.0):
        with self.cv:
            assert self.cv.wait_for(predicate, timeout), f"done={self.done} failed={self.failed}"


@pytest.fixture
def receiver():
    rec = Recorder()
    r = TcpKVReceiver(LAYOUT, on_layer=rec.on_layer, on_done=rec.on_done, on_failed=rec.on_failed, token=TOKEN,
                      max_room_tokens=64)
    yield r, rec
    r.close()


def raw_peer(endpoint: str, token: str | None = TOKEN) -> tuple[socket.socket, dict]:
    """A hand-driven sender: connects and says HELLO; returns the socket and the receiver's answer."""
    sock = socket.create_connection(wire.parse_endpoint(endpoint), timeout=5)
    hello = {"kind": wire.HELLO, "version": wire.VERSION, "layout": LAYOUT.to_dict()}
    if token is not None:
        hello["token"] = token
    wire.send_frame(sock, hello)
    return sock, wire.recv_frame(sock)[0]


def layer_frame(room, layer, rows: torch.Tensor, **override):
    payload = wire.tensor_bytes(rows)
    header = {"kind": wire.LAYER, "room": room, "layer": layer, "num_tokens": rows.shape[0],
              "crc32": wire.payload_crc32(payload), **override}
    return header, payload


def closed_by_peer(sock: socket.socket, timeout=3.0) -> bool:
    """True once the receiver has closed the connection (answers it may have sent first are skipped)."""
    sock.settimeout(timeout)
    try:
        while wire.recv_frame(sock) is not None:
            pass
        return True
    except (ConnectionError, OSError):
        return True


def send_good_room(receiver, room, n, pages):
    rows = torch.randn(LAYERS, n, KV_DIM)
    receiver.expect(room, n, pages, LAYERS)
    sender = TcpKVSender(LAYOUT, token=TOKEN)
    h = sender.begin(receiver.endpoint, room, LAYERS)
    return sender, h, rows


def test_hello_without_or_with_a_wrong_token_is_refused(receiver):
    r, rec = receiver
    for token in (None, "", "s3cre", "s3cret!"):
        sock, answer = raw_peer(r.endpoint, token)
        assert answer["kind"] == wire.HELLO_ERROR and answer["error_kind"] == "unauthenticated"
        assert "layout" not in answer["message"]  # a stranger learns nothing about this worker
        assert closed_by_peer(sock)
        sock.close()
    with TcpKVSender(LAYOUT, token="wrong") as sender, pytest.raises(KVTransferError) as err:
        sender.begin(r.endpoint, 1, LAYERS)
    assert err.value.kind == "unauthenticated" and "--internal-token" in str(err.value)


@pytest.mark.parametrize("attack", ["wrong byte size", "layer out of range", "more tokens than expected",
                                    "negative layer", "non-integer tokens", "aux size lies"])
def test_malicious_peer_is_refused_without_touching_other_rooms(receiver, attack):
    r, rec = receiver
    # An honest transfer into room 1 runs alongside on its own connection.
    sender, good, good_rows = send_good_room(r, 1, 6, [3, 9])
    r.expect(2, 5, [0, 1], LAYERS)
    sock, answer = raw_peer(r.endpoint)
    assert answer["kind"] == wire.HELLO_OK
    rows = torch.ones(5, KV_DIM)
    if attack == "wrong byte size":
        header, payload = layer_frame(2, 0, rows)
        payload = bytes(payload)[:-4]
        header["crc32"] = wire.payload_crc32(payload)
    elif attack == "layer out of range":
        header, payload = layer_frame(2, LAYERS, rows)
    elif attack == "negative layer":
        header, payload = layer_frame(2, -1, rows)
    elif attack == "more tokens than expected":
        header, payload = layer_frame(2, 0, torch.ones(9, KV_DIM))
    elif attack == "non-integer tokens":
        header, payload = layer_frame(2, 0, rows, num_tokens="5")
    else:
        header = {"kind": wire.AUX, "room": 2, "fields": {"first_token_id": 1, "cached_tokens": 0},
                  "hidden_dtype": "float32", "hidden_shape": [1000], "hidden_nbytes": 4000, "rng_nbytes": 0}
        payload = b"\0" * 8
    wire.send_frame(sock, header, payload)
    rec.wait_for(lambda: any(room == 2 for room, _ in rec.failed))
    (room, error), = [f for f in rec.failed if f[0] == 2]
    assert error.kind == "protocol" and "bad" in str(error)
    assert closed_by_peer(sock), "the connection of a peer sending bad frames stays open"
    sock.close()
    assert not [x for x in rec.layers if x[0] == 2], "rows of a bad frame reached the pages"
    # The honest room is unaffected.
    for layer in range(LAYERS):
        good.send_layer(layer, good_rows[layer])
    good.finish({"first_token_id": 7, "cached_tokens": 0})
    good.wait(timeout=5)
    rec.wait_for(lambda: rec.done)
    got = {layer: values for room, layer, _, values in rec.layers if room == 1}
    assert all(torch.equal(got[layer], good_rows[layer]) for layer in range(LAYERS))
    sender.close()


def test_a_room_cannot_be_written_from_another_connection(receiver):
    r, rec = receiver
    sender, good, rows = send_good_room(r, 5, 6, [3, 9])
    good.send_layer(0, rows[0])
    rec.wait_for(lambda: rec.layers)
    sock, _ = raw_peer(r.endpoint)
    wire.send_frame(sock, *layer_frame(5, 1, torch.zeros(6, KV_DIM)))  # an intruder writes layer 1 of room 5
    assert closed_by_peer(sock)
    sock.close()
    for layer in (1, 2):
        good.send_layer(layer, rows[layer])
    good.finish({"first_token_id": 1, "cached_tokens": 0})
    good.wait(timeout=5)
    assert [torch.equal(v, rows[layer]) for room, layer, _, v in rec.layers] == [True] * LAYERS
    assert not rec.failed
    sender.close()


def test_an_oversized_frame_is_refused_before_allocation(receiver):
    r, rec = receiver
    r.expect(3, 5, [0, 1], LAYERS)
    sock, _ = raw_peer(r.endpoint)
    body = b'{"kind":"LAYER","room":3,"layer":0,"num_tokens":5}'
    # Announces a 1 TiB payload; the receiver must not try to allocate it.
    sock.sendall(wire.FRAME_HEADER.pack(wire.MAGIC, wire.VERSION, len(body), 1 << 40) + body)
    assert closed_by_peer(sock)
    sock.close()
    # Room 3 never accepted a frame from that connection, so it still waits for its real sender, who gets through.
    assert r.num_pending == 1 and not rec.failed
    with TcpKVSender(LAYOUT, token=TOKEN) as sender:
        h = sender.begin(r.endpoint, 3, LAYERS)
        for layer in range(LAYERS):
            h.send_layer(layer, torch.ones(5, KV_DIM))
        h.finish({"first_token_id": 1, "cached_tokens": 0})
        h.wait(timeout=5)


def test_corrupted_layer_fails_the_room_with_a_checksum_error(receiver):
    r, rec = receiver
    r.expect(4, 5, [0, 1], LAYERS)
    sock, _ = raw_peer(r.endpoint)
    header, payload = layer_frame(4, 0, torch.randn(5, KV_DIM))  # crc32 of the clean rows
    corrupted = bytearray(payload)
    corrupted[17] ^= 0x10  # one bit flipped in transit
    wire.send_frame(sock, header, bytes(corrupted))
    rec.wait_for(lambda: rec.failed)
    (room, error), = rec.failed
    assert room == 4 and error.kind == "protocol" and "checksum" in str(error)
    assert not rec.layers, "corrupted rows reached the pages"
    reply = wire.recv_frame(sock)[0]  # the sender is told why
    assert reply["kind"] == wire.ROOM_FAILED and "checksum" in reply["message"]
    sock.close()


def test_checksums_are_sent_by_default_and_verified(receiver, monkeypatch):
    from pdserve.kv_transfer import control_sender

    sent = []

    def spy(header, *payload):
        sent.append(header)
        return wire.encode_frame(header, *payload)

    monkeypatch.setattr(control_sender, "encode_frame", spy)
    r, rec = receiver
    sender, h, rows = send_good_room(r, 6, 3, [2])
    for layer in range(LAYERS):
        h.send_layer(layer, rows[layer])
    h.finish({"first_token_id": 1, "cached_tokens": 0, "hidden": torch.ones(4), "rng_state": b"xyz"})
    h.wait(timeout=5)
    data = [hd for hd in sent if hd["kind"] in (wire.LAYER, wire.AUX)]
    assert len(data) == LAYERS + 1 and all(isinstance(hd.get("crc32"), int) for hd in data)
    rec.wait_for(lambda: rec.done)
    sender.close()


def _frame_start(json_len: int) -> bytes:
    """The fixed part of a frame announcing a `json_len`-byte header and no payload."""
    return wire.FRAME_HEADER.pack(wire.MAGIC, wire.VERSION, json_len, 0)


def _closed(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_hello_trickled_in_is_cut_at_the_handshake_deadline():
    """A stranger announcing a large HELLO and sending a byte now and then holds no thread past the handshake's one
    deadline (it was a timeout per read, reset by every byte)."""
    rec = Recorder()
    r = TcpKVReceiver(LAYOUT, on_layer=rec.on_layer, on_done=rec.on_done, on_failed=rec.on_failed, token=TOKEN,
                      handshake_timeout_s=1.0)
    try:
        sock = socket.create_connection(wire.parse_endpoint(r.endpoint), timeout=5)
        sock.sendall(_frame_start(4096))
        start, closed = time.monotonic(), False
        while time.monotonic() - start < 4 and not closed:
            try:
                sock.sendall(b" ")
            except OSError:
                closed = True
                break
            closed = _closed(sock, 0.3)
        assert closed and time.monotonic() - start < 2.5, "the trickling peer kept its connection"
    finally:
        r.close()


def test_a_hello_header_larger_than_a_hello_is_refused_before_allocation(receiver):
    r, _ = receiver
    sock = socket.create_connection(wire.parse_endpoint(r.endpoint), timeout=5)
    sock.sendall(_frame_start(wire.MAX_JSON_BYTES))  # allowed for data frames, far beyond any HELLO
    assert _closed(sock, 2.0)


def test_handshakes_pending_from_one_host_are_bounded_and_a_real_sender_pairs_after():
    """Connections that never say HELLO: at most MAX_HANDSHAKES_PER_HOST hold a thread, the rest are closed at once;
    once the idle ones reach their deadline a real sender pairs and its room completes."""
    from pdserve.kv_transfer.control_receiver import MAX_HANDSHAKES_PER_HOST

    rec = Recorder()
    r = TcpKVReceiver(LAYOUT, on_layer=rec.on_layer, on_done=rec.on_done, on_failed=rec.on_failed, token=TOKEN,
                      handshake_timeout_s=1.0)
    idle = []
    try:
        threads_before = threading.active_count()
        for _ in range(MAX_HANDSHAKES_PER_HOST + 24):
            idle.append(socket.create_connection(wire.parse_endpoint(r.endpoint), timeout=5))
        time.sleep(0.3)
        assert threading.active_count() - threads_before <= MAX_HANDSHAKES_PER_HOST
        assert r.refused_connections >= 24
        time.sleep(1.2)  # the pending ones reach their handshake deadline
        sender = TcpKVSender(LAYOUT, token=TOKEN)
        try:
            h = sender.begin(r.endpoint, 7, LAYERS)
            r.expect(7, 5, [0, 1], LAYERS)
            for layer in range(LAYERS):
                h.send_layer(layer, torch.ones(5, KV_DIM))
            h.finish({"first_token_id": 1, "cached_tokens": 0, "hidden": None, "rng_state": b""})
            h.wait(timeout=5)
        finally:
            sender.close()
        rec.wait_for(lambda: any(room == 7 for room, _ in rec.done))
    finally:
        for s in idle:
            s.close()
        r.close()
