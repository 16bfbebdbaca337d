"""Decode side of the TCP KV transport: a listening socket that writes prefill's rows into reserved pages.

Threads (all daemons): one accept thread, one thread per sender connection (reads frames, delivers on_layer /
on_done and the failures it detects), one timer thread (room deadlines), one notifier thread (writes ROOM_DONE /
ROOM_FAILED to senders, so no caller ever blocks on a slow peer).
"""

from __future__ import annotations

import hmac
import logging
import math
import queue
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

from .base import (
    KVLayout, KVReceiver, KVTransferError, OnDone, OnFailed, OnLayer, TransferState, TransferStatus,
    dtype_from_name, token_slots,
)
from .wire import (
    ABORT, AUX, HELLO, HELLO_ERROR, HELLO_OK, LAYER, ROOM_DONE, ROOM_FAILED, ProtocolError, configure_socket,
    payload_crc32, recv_frame, send_frame,
)

logger = logging.getLogger(__name__)

_MAX_REMEMBERED = 4096  # finished rooms whose late frames are still answered with the right error kind
_MAX_AUX_PAYLOAD = 64 << 20  # hidden state (hidden_size floats) + RNG state: far below this for any model
_DEFAULT_MAX_ROOM_TOKENS = 1 << 20  # when the owner does not say how many tokens its pool holds
HELLO_MAX_JSON_BYTES = 64 << 10  # a HELLO is a layout and a few facts: far below this
# Connections accepted and not yet through their handshake, each a thread: from one host, and in all.
MAX_HANDSHAKES_PER_HOST, MAX_HANDSHAKES = 16, 256


class _PeerConn:
    """One sender connection, as seen by the receiver."""

    def __init__(self, sock: socket.socket, addr: str):
        self.sock, self.addr = sock, addr
        self.send_lock = threading.Lock()

    def send(self, header: dict[str, Any]) -> None:
        try:
            with self.send_lock:
                send_frame(self.sock, header)
        except OSError:
            pass  # the connection thread notices the broken socket and fails the rooms


class _Room:
    def __init__(self, room: int, num_tokens: int, dst_slots: torch.Tensor, num_layers: int, deadline: float):
        self.room, self.num_tokens, self.dst_slots, self.num_layers = room, num_tokens, dst_slots, num_layers
        self.deadline = deadline
        self.status = TransferStatus(TransferState.WAITING_FOR_DEST)
        self.layers: set[int] = set()
        self.aux: dict[str, Any] | None = None
        self.conn: _PeerConn | None = None  # the connection its frames came in on
        self.pool_slots: torch.Tensor | None = None  # dst_slots on the pool's device, made at the first layer

    def progress(self) -> str:
        return f"{len(self.layers)}/{self.num_layers} layers, aux {'received' if self.aux is not None else 'missing'}"


class TcpKVReceiver(KVReceiver):
    """See `KVReceiver`. `endpoint` advertises `advertise_host` (default: `host`) and the port actually bound."""

    transport = "tcp"  # a sender announcing another transport in HELLO is refused as "incompatible"
    peer_conn_cls = _PeerConn
    data_kinds = (LAYER, AUX, ABORT)  # frames a paired sender may send

    def __init__(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, *, on_layer: OnLayer,
                 on_done: OnDone, on_failed: OnFailed, timeout_s: float = 300.0, handshake_timeout_s: float = 10.0,
                 advertise_host: str | None = None, token: str | None = None, max_room_tokens: int | None = None,
                 kv_buffer: torch.Tensor | None = None):
        """token: senders must present it in HELLO (None: no check). max_room_tokens: the most tokens a room can
        have (the KV pool's capacity); bounds the payload a peer may announce. kv_buffer: the decode pool
        `(num_layers, num_slots, kv_dim)`; given, each layer's rows are written into the room's pages on this
        receiver's thread and on_layer gets values=None (so the decode engine's thread never copies KV); without
        it the rows go to on_layer."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        self.layout, self.timeout_s, self.handshake_timeout_s = layout, timeout_s, handshake_timeout_s
        self._token = token
        self._max_room_tokens = max_room_tokens or _DEFAULT_MAX_ROOM_TOKENS
        row_bytes = layout.kv_dim * layout.torch_dtype.itemsize
        self._max_payload = max(_MAX_AUX_PAYLOAD, self._max_room_tokens * row_bytes)
        self._on_layer, self._on_done, self._on_failed = on_layer, on_done, on_failed
        self._pool = kv_buffer
        self._copy_stream = None  # a CUDA pool's rows are copied on their own stream, beside the decode steps
        # NOTE: re-entrant because callbacks run under it and may call cancel()/expect().
        self._lock = threading.RLock()
        self._rooms: dict[int, _Room] = {}
        self._dropped: OrderedDict[int, tuple[str, str]] = OrderedDict()  # room -> (error kind, message)
        self._conns: dict[_PeerConn, threading.Thread] = {}
        self._handshaking: dict[str, int] = {}  # host -> its connections not yet through the handshake
        self.refused_connections = 0  # closed at accept: their host had too many handshakes pending
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)  # the accept loop checks for close() this often
        self._endpoint = f"{advertise_host or host}:{self._listener.getsockname()[1]}"
        tick = min(0.1, timeout_s / 5)
        self._threads = [
            threading.Thread(target=self._accept_loop, name="kv-recv-accept", daemon=True),
            threading.Thread(target=self._timer_loop, args=(tick,), name="kv-recv-timer", daemon=True),
            threading.Thread(target=self._notify_loop, name="kv-recv-notify", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- public API ----

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._rooms)

    def expect(self, room: int, num_tokens: int, dst_pages: Sequence[int], num_layers: int) -> None:
        if not 0 <= room < 2**64:
            raise ValueError(f"room={room} must be a uint64")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens={num_tokens} must be positive")
        if not 0 < num_layers <= self.layout.num_kv_layers:
            raise ValueError(f"num_layers={num_layers} must be in [1, {self.layout.num_kv_layers}]")
        slots = token_slots(dst_pages, num_tokens, self.layout.page_size)  # (num_tokens,)
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("TcpKVReceiver is closed")
            if room in self._rooms:
                raise ValueError(f"room {room} is already expected")
            r = self._new_room(room, num_tokens, dst_pages, slots, num_layers, time.monotonic() + self.timeout_s)
            self._dropped.pop(room, None)
            self._rooms[room] = r

    def _new_room(self, room: int, num_tokens: int, dst_pages: Sequence[int], slots: torch.Tensor, num_layers: int,
                  deadline: float) -> _Room:
        """Called by expect() with the lock held; may raise ValueError."""
        return _Room(room, num_tokens, slots, num_layers, deadline)

    def cancel(self, room: int) -> bool:
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return False
            self._drop_locked(r, "aborted", f"room {room} was cancelled by the decode worker", callback=False)
            return True

    def close(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
            for r in list(self._rooms.values()):
                self._drop_locked(r, "aborted", f"room {r.room}: the KV receiver closed ({r.progress()})",
                                  notify=False)
            conns = dict(self._conns)
        self._outbox.put(None)
        for t in self._threads:
            t.join(timeout=2.0)
        self._listener.close()
        for conn, t in conns.items():
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, which closes the socket
            except OSError:
                pass
            t.join(timeout=2.0)

    # ---- room bookkeeping (callers hold self._lock) ----

    def _drop_locked(self, r: _Room, kind: str, message: str, notify: bool = True, callback: bool = True) -> None:
        """Fail room `r` once: forget it, remember why (for late frames), tell its sender, call on_failed."""
        if not r.status.fail(kind, message):
            return
        del self._rooms[r.room]
        self._remember_locked(r.room, kind, message)
        if notify and r.conn is not None:
            self._outbox.put((r.conn, {"kind": ROOM_FAILED, "room": r.room, "error_kind": kind, "message": message}))
        if callback:
            self._call(self._on_failed, r.room, self._room_error(r, kind, message))

    def _room_error(self, r: _Room, kind: str, message: str) -> KVTransferError:
        """The error on_failed gets for room `r`; `transport` says what its rows travelled over."""
        error = KVTransferError(kind, message)
        error.transport = self.transport
        return error

    def _complete_if_ready_locked(self, r: _Room) -> None:
        """Every layer landed and the aux record is in: confirm to the sender, then on_done."""
        if len(r.layers) != r.num_layers or r.aux is None:
            return
        r.status.advance(TransferState.DONE)
        del self._rooms[r.room]
        self._remember_locked(r.room, "protocol", f"room {r.room} already completed")
        self._outbox.put((r.conn, {"kind": ROOM_DONE, "room": r.room}))
        self._call(self._on_done, r.room, r.aux)

    def _refuse_unknown_locked(self, conn: _PeerConn, kind: str, room: int) -> None:
        """A frame for a room that is not (or no longer) expected: tell the sender why, unless it is an ABORT."""
        if kind == ABORT:
            return  # an ABORT for a finished room needs no answer
        err_kind, message = self._dropped.get(room, (
            "protocol", f"room {room} is not expected by this decode worker (expect() must be called "
                        f"before the room is handed to prefill)"))
        self._outbox.put((conn, {"kind": ROOM_FAILED, "room": room, "error_kind": err_kind, "message": message}))

    def _remember_locked(self, room: int, kind: str, message: str) -> None:
        self._dropped[room] = (kind, message)
        while len(self._dropped) > _MAX_REMEMBERED:
            self._dropped.popitem(last=False)

    @staticmethod
    def _call(fn: Callable[..., None], *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except Exception:
            logger.exception("KV receiver callback %s raised", getattr(fn, "__name__", fn))
            return False

    # ---- frames ----

    def _on_data(self, conn: _PeerConn, kind: str, header: dict[str, Any], payload: torch.Tensor) -> None:
        room = header.get("room")
        if not isinstance(room, int):
            raise ProtocolError(f"{kind} frame without an integer room: {header!r}")
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                self._refuse_unknown_locked(conn, kind, room)
                return
            if r.conn is not None and r.conn is not conn:
                # Only the connection that started a room may write into it: one peer cannot touch another's rows.
                raise ProtocolError(f"{kind} frame for room {room}, which another connection is sending")
            r.conn = conn
            if kind == ABORT:
                self._drop_locked(r, "aborted", f"room {room} was aborted by the prefill worker ({r.progress()})",
                                  notify=False)
                return
            crc = header.get("crc32")
            if crc is not None and crc != payload_crc32(memoryview(payload.numpy())):
                # The framing is intact (lengths matched), only the bytes differ: fail the room, keep the link.
                self._drop_locked(r, "protocol", f"room {room}: {kind} frame failed its checksum (crc32 "
                                                 f"{crc!r} announced); the KV data was corrupted in transit")
                return
            try:
                if kind == LAYER:
                    layer, values = self._parse_layer(r, header, payload)
                else:
                    aux = self._parse_aux(r, header, payload)
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                self._drop_locked(r, "protocol", f"room {room}: bad {kind} frame: {e}")
                # A peer that sends the wrong shapes cannot be trusted with the rest of its frames.
                raise ProtocolError(f"bad {kind} frame for room {room}: {e}") from None
            r.status.advance(TransferState.TRANSFERRING)
            if kind == LAYER:
                r.layers.add(layer)
                if self._pool is not None:
                    self._write_rows(r, layer, values)
                    values = None
                if not self._call(self._on_layer, room, layer, r.dst_slots, values):
                    self._drop_locked(r, "aborted", f"room {room}: the decode worker's on_layer callback raised")
                    return
            else:
                r.aux = aux
            self._complete_if_ready_locked(r)

    def _write_rows(self, r: _Room, layer: int, values: torch.Tensor) -> None:
        """The layer's rows into the room's reserved slots of the pool.

        NOTE: synchronous (the copy stream is waited for here, with the GIL released), so once cancel() returns no
        write of the room can still land in pages the decode worker then frees and hands to another request."""
        pool = self._pool
        if pool.device.type != "cuda":
            if r.pool_slots is None:
                r.pool_slots = r.dst_slots.to(pool.device)
            pool[layer].index_copy_(0, r.pool_slots, values.to(pool.dtype))
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(pool.device)
        with torch.cuda.stream(self._copy_stream):
            if r.pool_slots is None:
                r.pool_slots = r.dst_slots.to(pool.device, non_blocking=True)
            pool[layer].index_copy_(0, r.pool_slots, values.to(pool.device, pool.dtype, non_blocking=True))
        self._copy_stream.synchronize()

    def _parse_layer(self, r: _Room, header: dict[str, Any], payload: torch.Tensor) -> tuple[int, torch.Tensor]:
        layer, n = header["layer"], header["num_tokens"]
        if not (_is_int(layer) and 0 <= layer < r.num_layers):
            raise ValueError(f"layer {layer!r} is outside the room's {r.num_layers} layers")
        if layer in r.layers:
            raise ValueError(f"layer {layer} arrived twice")
        if not _is_int(n) or n != r.num_tokens:
            raise ValueError(f"prefill sent {n} tokens, decode expected {r.num_tokens}")
        itemsize = self.layout.torch_dtype.itemsize
        if payload.numel() != n * self.layout.kv_dim * itemsize:
            raise ValueError(f"payload of {payload.numel()} bytes is not {n} x {self.layout.kv_dim} x {itemsize}")
        return layer, payload.view(self.layout.torch_dtype).view(n, self.layout.kv_dim)  # (num_tokens, kv_dim)

    @staticmethod
    def _parse_aux(r: _Room, header: dict[str, Any], payload: torch.Tensor) -> dict[str, Any]:
        if r.aux is not None:
            raise ValueError("aux arrived twice")
        if not isinstance(header["fields"], dict):
            raise ValueError(f"aux fields must be an object, got {type(header['fields']).__name__}")
        aux = dict(header["fields"])
        h_bytes, rng_bytes = header["hidden_nbytes"], header["rng_nbytes"]
        if not (_is_int(h_bytes) and _is_int(rng_bytes) and h_bytes >= 0 and rng_bytes >= 0):
            raise ValueError(f"aux sizes must be non-negative integers, got {h_bytes!r} and {rng_bytes!r}")
        if h_bytes + rng_bytes != payload.numel():
            raise ValueError(f"aux payload of {payload.numel()} bytes, header says {h_bytes} + {rng_bytes}")
        aux["hidden"] = None
        if header.get("hidden_dtype") is not None:
            dtype, shape = dtype_from_name(str(header["hidden_dtype"])), header["hidden_shape"]
            if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
                raise ValueError(f"hidden_shape must be a list of sizes, got {shape!r}")
            if math.prod(shape) * dtype.itemsize != h_bytes:
                raise ValueError(f"hidden_shape {shape} of {dtype} is not {h_bytes} bytes")
            aux["hidden"] = payload[:h_bytes].view(dtype).view(shape)
        aux["rng_state"] = payload[h_bytes:].numpy().tobytes()
        return aux

    # ---- threads ----

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                logger.exception("KV receiver %s: accept failed", self._endpoint)
                time.sleep(0.1)
                continue
            conn = self.peer_conn_cls(sock, f"{addr[0]}:{addr[1]}")
            t = threading.Thread(target=self._serve, args=(conn,), name=f"kv-recv-{conn.addr}", daemon=True)
            with self._lock:
                if self._stop.is_set():
                    sock.close()
                    return
                if not self._may_handshake_locked(addr[0]):
                    sock.close()  # a host that opens connections and never says HELLO gets no more threads
                    continue
                self._conns[conn] = t
            t.start()

    def _may_handshake_locked(self, host: str) -> bool:
        """Count a new connection from `host` as handshaking, unless too many (from it, or from all) already are."""
        pending = self._handshaking.get(host, 0)
        if pending >= MAX_HANDSHAKES_PER_HOST or sum(self._handshaking.values()) >= MAX_HANDSHAKES:
            self.refused_connections += 1
            if self.refused_connections in (1, 10, 100) or self.refused_connections % 1000 == 0:
                logger.warning("KV receiver %s: closed a connection from %s at once: %d connections from it (%d "
                               "in all) have not completed their handshake (%d closed so far)", self._endpoint, host,
                               pending, sum(self._handshaking.values()), self.refused_connections)
            return False
        self._handshaking[host] = pending + 1
        return True

    def _handshake_over(self, conn: _PeerConn) -> None:
        host = conn.addr.rsplit(":", 1)[0]
        with self._lock:
            left = self._handshaking.get(host, 0) - 1
            if left > 0:
                self._handshaking[host] = left
            else:
                self._handshaking.pop(host, None)

    def _serve(self, conn: _PeerConn) -> None:
        kind, why = "peer_failed", f"the prefill connection from {conn.addr} closed mid-transfer"
        handshaking = True
        try:
            configure_socket(conn.sock)
            paired = self._handshake(conn)
            self._handshake_over(conn)
            handshaking = False
            if not paired:
                return
            conn.sock.settimeout(None)
            while not self._stop.is_set():
                frame = recv_frame(conn.sock, self._max_payload)
                if frame is None:
                    break
                header, payload = frame
                if header["kind"] not in self.data_kinds:
                    raise ProtocolError(f"unexpected {header['kind']} frame")
                self._on_data(conn, header["kind"], header, payload)
        except ProtocolError as e:
            kind, why = "protocol", f"the prefill connection from {conn.addr} sent garbage ({e})"
        except OSError as e:
            why += f" ({e})"
        finally:
            if handshaking:
                self._handshake_over(conn)
            with self._lock:
                self._conns.pop(conn, None)
                for r in [r for r in self._rooms.values() if r.conn is conn]:
                    self._drop_locked(r, kind, f"room {r.room}: {why} after {r.progress()}", notify=False)
            self._disconnected(conn)
            conn.sock.close()

    def _transport_problem(self, conn: _PeerConn, header: dict[str, Any]) -> str | None:
        """Why this receiver cannot pair with the sender's transport (HELLO's "transport"), None when it can."""
        transport = header.get("transport", "tcp")  # senders older than the transport field spoke TCP
        if transport == self.transport or (transport == "auto" and self.transport == "tcp"):
            return None  # an "auto" sender pairs over tcp with a tcp receiver (HELLO_OK names no other transport)
        return (f"KV transport mismatch: prefill {transport!r} vs decode {self.transport!r} (give both workers the "
                f"same --kv-transport)")

    def _paired(self, conn: _PeerConn) -> bool:
        """After HELLO_OK went out: set up whatever else the transport needs with this sender; False drops it."""
        return True

    def _hello_ok(self, conn: _PeerConn) -> dict[str, Any]:
        """Extra fields of this transport's HELLO_OK."""
        return {}

    def _disconnected(self, conn: _PeerConn) -> None:
        """The connection ended and its rooms were failed; release what `_paired` set up."""

    def _handshake(self, conn: _PeerConn) -> bool:
        # NOTE: before the token check nothing is trusted: a small header only, and one deadline for all of it.
        frame = recv_frame(conn.sock, max_payload=0, max_json=HELLO_MAX_JSON_BYTES,
                           deadline=time.monotonic() + self.handshake_timeout_s)
        if frame is None:
            return False
        header, _ = frame
        if self._token is not None and not _token_ok(header.get("token"), self._token):
            # Checked before the layout, so a stranger learns nothing about this worker.
            logger.warning("KV receiver %s refused %s: missing or wrong internal token", self._endpoint, conn.addr)
            conn.send({"kind": HELLO_ERROR, "error_kind": "unauthenticated",
                       "message": "missing or wrong internal token: give both workers the same --internal-token"})
            return False
        try:
            if header["kind"] != HELLO:
                raise ValueError(f"expected HELLO, got {header['kind']}")
            problem = KVLayout.from_dict(header["layout"]).mismatch(self.layout, ("prefill", "decode"))
            problem = problem and f"KV layout mismatch: {problem}"
            problem = problem or self._transport_problem(conn, header)
        except (ValueError, KeyError, TypeError) as e:
            problem = f"bad HELLO: {e}"
        if problem:
            logger.warning("KV receiver %s refused prefill %s: %s", self._endpoint, conn.addr, problem)
            conn.send({"kind": HELLO_ERROR, "message": problem})
            return False
        conn.send({"kind": HELLO_OK, **self._hello_ok(conn)})
        return self._paired(conn)

    def _timer_loop(self, tick: float) -> None:
        while not self._stop.wait(tick):
            now = time.monotonic()
            with self._lock:
                for r in [r for r in self._rooms.values() if now >= r.deadline]:
                    self._drop_locked(r, "timeout", f"room {r.room}: the KV transfer did not complete within "
                                                    f"{self.timeout_s:g} s of expect() ({r.progress()})")
                self._on_tick_locked(now)

    def _on_tick_locked(self, now: float) -> None:
        """Every timer tick, with the lock held, after the deadlines were applied."""

    def _notify_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            conn, header = item
            conn.send(header)



def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_ok(given: Any, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
