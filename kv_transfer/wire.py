"""TCP wire format of the KV transfer: length-prefixed frames.

    frame := header (struct FRAME_HEADER: magic "PDKV", version u8, json_len u32, payload_len u64)
             json_len bytes of UTF-8 JSON ({"kind": ..., fields})
             payload_len raw bytes (tensor rows in native byte order, opaque blobs)

Frame kinds, sender -> receiver: HELLO {layout, version, token}; LAYER {room, layer, num_tokens, crc32} + rows;
AUX {room, fields, hidden_dtype, hidden_shape, hidden_nbytes, rng_nbytes, crc32} + hidden bytes + rng blob;
ABORT {room}. Receiver -> sender: HELLO_OK; HELLO_ERROR {message, error_kind}; ROOM_DONE {room};
ROOM_FAILED {room, error_kind, message}. The data planes other than tcp send LAYER frames without rows that may name
several layers ({room, layers, num_tokens}); cuda_ipc adds BEGIN {room, num_layers, pages} and its answer GRANT
{room, num_tokens} (`cuda_ipc_receiver.py`).

`crc32` (zlib.crc32 of the frame's payload) is optional on the wire and sent by default: TCP's own 16-bit checksum
lets rare corruption through, and a corrupted KV row would silently produce wrong tokens, so the receiver fails the
room instead. `token` is the shared internal token (`--internal-token`), compared in constant time.
"""

from __future__ import annotations

import json
import socket
import struct
import time
import zlib
from typing import Any

import torch

MAGIC = b"PDKV"
VERSION = 1
FRAME_HEADER = struct.Struct("!4sB3xIQ")
MAX_JSON_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 40

HELLO, HELLO_OK, HELLO_ERROR = "HELLO", "HELLO_OK", "HELLO_ERROR"
LAYER, AUX, ABORT = "LAYER", "AUX", "ABORT"
ROOM_DONE, ROOM_FAILED = "ROOM_DONE", "ROOM_FAILED"
BEGIN, GRANT = "BEGIN", "GRANT"

# Dead-peer detection for peers that vanish without closing the socket (power loss, partition), in the spirit
# of SGLang's 5 s heartbeat with 2 misses. A killed process is noticed at once: its kernel closes the socket.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 5, 5, 2


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame; the connection cannot be trusted any more."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"KV endpoint {endpoint!r} must look like host:port")
    return host.strip("[]"), int(port)


def configure_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # acks and small frames must not wait
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                       ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, opt):  # Linux; other platforms keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor (any dtype, including bfloat16) without copying when it is contiguous."""
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def payload_crc32(*payload: bytes | memoryview) -> int:
    crc = 0
    for p in payload:
        crc = zlib.crc32(p, crc)
    return crc


def encode_frame(header: dict[str, Any], *payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The buffers of one frame, to be written in order; raises TypeError/ValueError for a header that is not
    JSON-serialisable (on the caller's thread, not the writer's)."""
    body = json.dumps(header, separators=(",", ":")).encode()
    payload_len = sum(memoryview(p).nbytes for p in payload)
    head = FRAME_HEADER.pack(MAGIC, VERSION, len(body), payload_len) + body
    return [head, *(p for p in payload if memoryview(p).nbytes)]


def frame_nbytes(frame: list[bytes | memoryview]) -> int:
    return sum(memoryview(b).nbytes for b in frame)


def write_frame(sock: socket.socket, frame: list[bytes | memoryview]) -> None:
    """Raises OSError if the connection is broken."""
    for buf in frame:
        sock.sendall(buf)


def send_frame(sock: socket.socket, header: dict[str, Any], *payload: bytes | memoryview) -> None:
    write_frame(sock, encode_frame(header, *payload))


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> int:
    got = 0
    while got < view.nbytes:
        if deadline is not None:  # one deadline for the whole read: a peer trickling bytes cannot stretch it
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer did not send its frame in time")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def recv_frame(sock: socket.socket, max_payload: int = MAX_PAYLOAD_BYTES, max_json: int = MAX_JSON_BYTES,
               deadline: float | None = None) -> tuple[dict[str, Any], torch.Tensor] | None:
    """Read one frame: (json header, payload as a fresh uint8 tensor). None on a clean end of stream between
    frames; ConnectionError if the stream ends inside a frame; ProtocolError on garbage or on a header or payload
    larger than max_json / max_payload (checked before anything is allocated, so a peer cannot make this side
    allocate what it likes); TimeoutError past `deadline` (time.monotonic()), however the bytes trickle in."""
    raw = bytearray(FRAME_HEADER.size)
    got = _recv_into(sock, memoryview(raw), deadline)
    if got == 0:
        return None
    if got < len(raw):
        raise ConnectionError("connection closed inside a frame header")
    magic, version, json_len, payload_len = FRAME_HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}: the peer does not speak the pdserve KV protocol")
    if version != VERSION:
        raise ProtocolError(f"KV protocol version {version} from the peer, this side speaks {VERSION}")
    if json_len > MAX_JSON_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"implausible frame sizes (json {json_len} B, payload {payload_len} B)")
    if json_len > max_json:
        raise ProtocolError(f"frame header of {json_len} B exceeds this side's limit of {max_json} B")
    if payload_len > max_payload:
        raise ProtocolError(f"frame payload of {payload_len} B exceeds this side's limit of {max_payload} B")
    body = bytearray(json_len)
    if _recv_into(sock, memoryview(body), deadline) < json_len:
        raise ConnectionError("connection closed inside a frame header")
    try:
        header = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"frame header is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise ProtocolError(f"frame header {header!r} has no 'kind'")
    # NOTE: a fresh tensor per frame, received straight into its storage: the rows handed to on_layer own their
    # memory, so nothing here is reused underneath the decode engine.
    payload = torch.empty(payload_len, dtype=torch.uint8)
    if payload_len and _recv_into(sock, memoryview(payload.numpy())) < payload_len:
        raise ConnectionError("connection closed inside a frame payload")
    return header, payload
