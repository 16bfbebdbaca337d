"""Prefill side of the control channel every KV transport shares: one connection per decode endpoint, shared by all
rooms sent there, and what a room's rows become on the way is the pairing's data plane (`plane.py`).

Threads per connection (daemons): a writer that drains the connection's frame queue (so `send_layer` returns at
once and the next layer's forward overlaps the transfer) and a reader that applies the decode worker's answers
(ROOM_DONE / ROOM_FAILED, and those of the data plane) and notices a dead connection.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from pdserve.common.trace import mark

from .base import (
    ERROR_KINDS, KVLayout, KVSender, KVTransferError, SendHandle, TransferState, TransferStats, TransferStatus,
    dtype_name, room_key,
)
from .plane import PairAgain, SendPairing, SendPlane
from .wire import (
    ABORT, AUX, HELLO, HELLO_ERROR, HELLO_OK, ROOM_DONE, ROOM_FAILED, VERSION, ProtocolError, configure_socket,
    encode_frame, frame_nbytes, parse_endpoint, payload_crc32, recv_frame, send_frame, tensor_bytes, write_frame,
)

# The decode side only ever answers with payload-free frames.
_MAX_REPLY_PAYLOAD = 0


class Connection:
    """One control connection to a decode endpoint and its pairing's data plane."""

    def __init__(self, endpoint: str, sock: socket.socket, plane: SendPlane, checksum: bool = True):
        self.endpoint, self.sock, self.plane, self.checksum = endpoint, sock, plane, checksum
        self.transport = plane.name  # what the rows travel over (the `transport` label of the transfer metrics)
        self.lock = threading.Lock()
        self.handles: dict[int, RoomHandle] = {}
        self.broken: KVTransferError | None = None
        # (handle, frame kind, frame buffers or a callable building them on the writer thread, post) or None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        plane.conn = self
        self.writer = threading.Thread(target=self._write_loop, name=f"kv-send-w-{endpoint}", daemon=True)
        self.reader = threading.Thread(target=self._read_loop, name=f"kv-send-r-{endpoint}", daemon=True)
        self.writer.start()
        self.reader.start()

    def register(self, handle: RoomHandle) -> bool:
        with self.lock:
            if self.broken is not None:
                return False
            if handle.room in self.handles:
                raise ValueError(f"room {handle.room} is already being sent to {self.endpoint}")
            self.handles[handle.room] = handle
            return True

    def unregister(self, handle: RoomHandle) -> None:
        with self.lock:
            if self.handles.get(handle.room) is handle:
                del self.handles[handle.room]

    def put(self, handle: RoomHandle, kind: str, header: dict[str, Any], *payload: memoryview | bytes,
            post: Callable[[], None] | None = None) -> None:
        """Queue one frame. `post`, if given, runs on the writer thread right after the frame is written: the
        collective transports post a layer's sends there, so announcements and sends leave in one order."""
        self.queue.put((handle, kind, self.frame(handle, kind, header, *payload), post))

    def frame(self, handle: RoomHandle, kind: str, header: dict[str, Any], *payload: memoryview | bytes):
        """The buffers of one frame of `handle`'s room, counted in its bytes."""
        if self.checksum and payload:
            # NOTE: over rows already in host memory (a few GB/s, cheap next to the forward that produced them).
            header = {**header, "crc32": payload_crc32(*payload)}
        frame = encode_frame({"kind": kind, "room": handle.room, **header}, *payload)
        handle.bytes_sent += frame_nbytes(frame)
        return frame

    def break_(self, error: KVTransferError) -> None:
        """Fail every room on this connection with `error` and stop both threads (idempotent)."""
        with self.lock:
            if self.broken is None:
                self.broken = error
            handles = list(self.handles.values())
        for h in handles:
            h._fail(error.kind, error.message)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.queue.put(None)
        self.plane.broken(self.broken)  # the first error is the one worth logging

    def write_now(self, frame) -> bool:
        """Write one frame now: the writer thread's own call, also for a builder that announces rows as they land
        before it returns its last frame. False: the connection broke (and was broken here)."""
        try:
            write_frame(self.sock, frame)
            return True
        except OSError as e:
            self.break_(KVTransferError("peer_failed", f"sending to decode KV endpoint {self.endpoint} failed: {e}"))
            return False

    def _write_loop(self) -> None:
        while (item := self.queue.get()) is not None:
            handle, kind, frame, post = item
            if kind != ABORT and handle.status.state == TransferState.FAILED:
                continue  # the room is dead: drop its remaining frames so the link is free for the others
            if kind in (AUX, ABORT) or callable(frame):
                try:
                    if kind in (AUX, ABORT):
                        self.plane.drain(handle)  # each tells the decode worker that nothing more lands
                        mark("kv.drained", room_key(handle.room))
                    if callable(frame):  # rows still on their way (a device copy, a grant)
                        frame = frame()
                except RuntimeError as e:  # a CUDA error: this room's rows cannot be read
                    handle._fail("aborted", f"room {handle.room}: reading its rows off the GPU failed: {e}")
                    continue
                if not frame:  # the builder failed the room itself (None), or its rows are announced later ([])
                    continue
            if not self.write_now(frame):
                return
            if kind == AUX:
                mark("kv.aux_written", room_key(handle.room))
            if post is None:
                continue
            try:
                post()
            except Exception as e:  # the data plane refused the op: its op stream cannot be trusted any more
                self.break_(KVTransferError("peer_failed", f"sending room {handle.room}'s rows to decode KV endpoint "
                                                           f"{self.endpoint} failed: {e}"))
                return

    def _read_loop(self) -> None:
        try:
            while (frame := recv_frame(self.sock, _MAX_REPLY_PAYLOAD)) is not None:
                header, _ = frame
                with self.lock:
                    handle = self.handles.get(header.get("room"))
                if header["kind"] not in (ROOM_DONE, ROOM_FAILED):
                    if not self.plane.on_reply(header, handle):
                        raise ProtocolError(f"unexpected {header['kind']} frame")
                    continue
                if handle is None:
                    continue  # the room already finished here (aborted or timed out locally)
                if header["kind"] == ROOM_DONE:
                    mark("kv.done_read", room_key(handle.room))
                    handle._complete()
                else:
                    kind = header.get("error_kind")
                    handle._fail(kind if kind in ERROR_KINDS else "protocol",
                                 f"decode KV endpoint {self.endpoint}: {header.get('message')}")
            error = KVTransferError("peer_failed", f"decode KV endpoint {self.endpoint} closed the connection")
        except (ProtocolError, TypeError) as e:
            error = KVTransferError("protocol", f"decode KV endpoint {self.endpoint} sent garbage: {e}")
        except OSError as e:
            error = KVTransferError("peer_failed", f"connection to decode KV endpoint {self.endpoint} lost: {e}")
        self.break_(error)
        self.writer.join()
        self.sock.close()  # NOTE: only once both threads are done with it, so its fd is never reused under them
        self.plane.ended()
        while not self.queue.empty():  # frames never written (and their builders) hold rows and handles
            self.queue.get_nowait()


class RoomHandle(SendHandle):
    """See `SendHandle`. Use one handle from one thread; different handles may be used from different threads."""

    def __init__(self, conn: Connection, room: int, num_layers: int, layout: KVLayout, timeout_s: float,
                 dst_pages: Sequence[int] | None):
        self.room, self.num_layers, self.layout = room, num_layers, layout
        self.dst_pages = None if dst_pages is None else list(dst_pages)
        self.status = TransferStatus(TransferState.BOOTSTRAPPING)
        self._conn, self.timeout_s = conn, timeout_s
        self.transport, self.streams_layers = conn.plane.name, conn.plane.streams_layers
        self.plane_state: Any = None  # what the data plane keeps per room (cuda_ipc: its grant and last copy)
        self.num_tokens: int | None = None
        self.bytes_sent = 0
        # Layers the AUX frame announces instead of a LAYER frame of their own (the data plane defers the room's last
        # send there when the decode worker takes it: finish() follows it, so one frame less per room).
        self.aux_layers: list[int] = []
        self._layers: set[int] = set()
        self._finished = False
        self._event = threading.Event()
        self._t0 = time.monotonic()
        self._t_rows: float | None = None  # the first rows' hand-over: a transfer's time runs from there
        self._t_end: float | None = None
        self.deadline = self._t0 + timeout_s

    def send_rows(self, layer: int, source: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        self._send([layer], source, slots, 2)

    def send_layers(self, first_layer: int, source: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        if source.dim() != 3 or source.shape[0] == 0:
            raise ValueError(f"room {self.room}: send_layers takes (num_layers > 0, slots or tokens, kv_dim), got "
                             f"{tuple(source.shape)}")
        self._send(list(range(first_layer, first_layer + source.shape[0])), source, slots, 3)

    def _send(self, layers: list[int], source: torch.Tensor, slots: torch.Tensor | None, dims: int) -> None:
        """The arguments checked (ValueError before any change), the layers taken, the rows queued."""
        self.num_tokens = self._check_rows(layers, source, slots, dims)
        self._layers.update(layers)
        self._t_rows = self._t_rows or time.monotonic()
        mark("kv.send", room_key(self.room))  # (a trace keeps each point's first time: the first send's)
        if self.status.state != TransferState.FAILED:
            self._conn.plane.send(self, layers, source, slots)
        mark("kv.send_returned", room_key(self.room))

    @property
    def all_sent(self) -> bool:
        """Every layer of the room was handed over (inside the send that hands over the last ones, too)."""
        return len(self._layers) == self.num_layers

    def _check_rows(self, layers: list[int], source: torch.Tensor, slots: torch.Tensor | None, dims: int) -> int:
        """Argument mistakes raise ValueError before anything is queued; returns the token count. `dims` 2: one
        layer, `source` `(slots or tokens, kv_dim)`; 3: a consecutive run of layers, `(len(layers), ..., kv_dim)`,
        checked once for the whole run (a prompt's 61 layers are one call, not 61 checks on the engine's thread)."""
        if self._finished:
            raise ValueError(f"room {self.room}: send_layer({layers[0]}) after finish()")
        if not (0 <= layers[0] and layers[-1] < self.num_layers) or not self._layers.isdisjoint(layers):
            bad = next(x for x in layers if not 0 <= x < self.num_layers or x in self._layers)
            raise ValueError(f"room {self.room}: layer {bad} is out of range [0, {self.num_layers}) or repeated")
        num_tokens = slots.numel() if slots is not None else source.shape[-2] if source.dim() >= 2 else 0
        if source.dim() != dims or source.shape[-1] != self.layout.kv_dim or num_tokens == 0:
            shape = tuple(source.shape[-2:]) if dims == 3 else tuple(source.shape)
            raise ValueError(f"room {self.room}: values of shape {shape}, expected (num_tokens > 0, "
                             f"kv_dim={self.layout.kv_dim})")
        if slots is not None and slots.dim() != 1:
            raise ValueError(f"room {self.room}: slots of shape {tuple(slots.shape)}, expected (num_tokens,)")
        if source.dtype != self.layout.torch_dtype:
            raise ValueError(f"room {self.room}: values are {source.dtype}, the layout says {self.layout.dtype}")
        if self.num_tokens is not None and num_tokens != self.num_tokens:
            raise ValueError(f"room {self.room}: layer {layers[0]} has {num_tokens} tokens, earlier layers "
                             f"{self.num_tokens}")
        plane = self._conn.plane
        if plane.device is not None and source.device != plane.device:
            raise ValueError(f"room {self.room}: values are on {source.device}, this {plane.name} sender moves rows "
                             f"on {plane.device}")
        need = -(-num_tokens // self.layout.page_size)
        if plane.writes_pages and len(self.dst_pages) < need:
            raise ValueError(f"room {self.room}: {num_tokens} tokens need {need} destination pages, begin() was "
                             f"given {len(self.dst_pages)}")
        return num_tokens

    def finish(self, aux: dict[str, Any]) -> None:
        if self._finished:
            raise ValueError(f"room {self.room}: finish() called twice")
        missing = sorted(set(range(self.num_layers)) - self._layers)
        if missing:
            raise ValueError(f"room {self.room}: finish() before layer(s) {missing} were sent")
        for key in ("first_token_id", "cached_tokens"):
            if not isinstance(aux.get(key), int):
                raise ValueError(f"room {self.room}: aux[{key!r}] must be an int, got {aux.get(key)!r}")
        hidden, rng = aux.get("hidden"), bytes(aux.get("rng_state") or b"")
        header: dict[str, Any] = {
            "fields": {k: v for k, v in aux.items() if k not in ("hidden", "rng_state")},
            "hidden_dtype": None, "hidden_shape": None, "hidden_nbytes": 0, "rng_nbytes": len(rng),
        }
        if self.aux_layers:
            header["layers"] = self.aux_layers
        payload = [rng]
        if hidden is not None:
            h = hidden.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            header.update(hidden_dtype=dtype_name(h.dtype), hidden_shape=list(h.shape),
                          hidden_nbytes=h.numel() * h.element_size())
            payload.insert(0, tensor_bytes(h))
        if self.status.state != TransferState.FAILED:
            self._conn.put(self, AUX, header, *payload)
        self._finished = True
        mark("kv.finish_returned", room_key(self.room))

    def wait(self, timeout: float | None = None) -> TransferStats:
        limit = self.deadline - time.monotonic() if timeout is None else timeout
        if not self._event.wait(max(0.0, limit)):
            self._expire(self.timeout_s if timeout is None else timeout)
        mark("kv.wait_returned", room_key(self.room))
        error = self.status.exception()
        if error is not None:
            raise error
        return TransferStats(self.bytes_sent, self._t_end - (self._t_rows or self._t0))

    def poll(self) -> TransferState:
        if not self.status.finished and time.monotonic() >= self.deadline:
            self._expire(self.timeout_s)
        return self.status.state

    def abort(self) -> None:
        self._fail("aborted", f"room {self.room} was aborted by the prefill worker", local=True)

    def _expire(self, seconds: float) -> None:
        # The decode worker is told (ABORT): it releases the pages now, not at its own deadline.
        self._fail("timeout", f"room {self.room}: decode KV endpoint {self._conn.endpoint} did not confirm the "
                              f"transfer within {seconds:g} s", local=True)

    # ---- called by the connection's threads and its data plane ----

    def _complete(self) -> None:
        if self.status.advance(TransferState.DONE):
            self._t_end = time.monotonic()
            self._conn.unregister(self)
            self._event.set()

    def _fail(self, kind: str, message: str, local: bool = False) -> bool:
        if not self.status.fail(kind, message):
            return False
        self._t_end = time.monotonic()
        self._conn.unregister(self)
        self._event.set()
        self._conn.plane.failed(self, local)
        return True


class KVSenderChannel(KVSender):
    """See `KVSender`: the prefill side of every transport, its pairings made by `pairing_cls` (set by each
    transport's sender class). Connections are made on first use per endpoint, reused, and remade once broken.
    `token`: the shared internal token the decode receivers require (None: send none). `checksum`: send a CRC32 of
    every frame's payload (the receiver fails a room whose data does not match). `device`: where the rows live.
    Other options go to the pairing."""

    transport: str  # announced in HELLO: a decode worker that cannot pair with it refuses the pairing
    pairing_cls: type[SendPairing]

    def __init__(self, layout: KVLayout, connect_timeout_s: float | None = None, timeout_s: float = 300.0,
                 token: str | None = None, checksum: bool = True, device: torch.device | str | None = None,
                 **pairing_options: Any):
        self.layout, self.timeout_s, self.token, self.checksum = layout, timeout_s, token, checksum
        self.connect_timeout_s = self.pairing_cls.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pairing = self.pairing_cls(self, **pairing_options)
        self._lock = threading.Lock()
        self._conns: dict[str, Connection] = {}
        self._connect_locks: dict[str, threading.Lock] = {}
        self._closed = False

    def begin(self, endpoint: str, room: int, num_layers: int,
              dst_pages: Sequence[int] | None = None) -> RoomHandle:
        self._check_room(room, num_layers)
        for _ in range(2):  # a connection that broke between lookup and registration is remade once
            conn = self._connection(endpoint)
            handle = self._start(conn, room, num_layers, dst_pages)
            if handle is not None:
                return handle
        raise conn.broken

    def begin_if_paired(self, endpoint: str, room: int, num_layers: int,
                        dst_pages: Sequence[int] | None = None) -> RoomHandle | None:
        self._check_room(room, num_layers)
        with self._lock:
            conn = None if self._closed else self._conns.get(endpoint)
        if conn is None or conn.broken is not None:
            return None
        return self._start(conn, room, num_layers, dst_pages)

    def _check_room(self, room: int, num_layers: int) -> None:
        if not 0 <= room < 2**64:
            raise ValueError(f"room={room} must be a uint64")
        if not 0 < num_layers <= self.layout.num_kv_layers:
            raise ValueError(f"num_layers={num_layers} must be in [1, {self.layout.num_kv_layers}]")

    def _start(self, conn: Connection, room: int, num_layers: int,
               dst_pages: Sequence[int] | None) -> RoomHandle | None:
        """The room's handle on `conn`, registered and opened by its plane; None when the connection broke."""
        if conn.plane.writes_pages and dst_pages is None:
            raise ValueError(f"the {conn.plane.name} KV transport writes into the decode worker's pages: begin() "
                             "needs dst_pages")
        handle = RoomHandle(conn, room, num_layers, self.layout, self.timeout_s, dst_pages)
        if not conn.register(handle):
            return None
        try:
            conn.plane.open_room(handle)
        except BaseException:
            conn.unregister(handle)
            raise
        handle.status.advance(TransferState.TRANSFERRING)
        return handle

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.break_(KVTransferError("aborted", "the KV sender was closed"))
        for c in conns:
            c.reader.join(timeout=2.0)

    def _connection(self, endpoint: str) -> Connection:
        with self._lock:
            if self._closed:
                raise KVTransferError("aborted", "the KV sender is closed")
            connect_lock = self._connect_locks.setdefault(endpoint, threading.Lock())
        with connect_lock:  # one handshake per endpoint at a time; other endpoints are not held up
            conn = self._conns.get(endpoint)
            if conn is not None and conn.broken is None:
                return conn
            try:
                conn = self._connect(endpoint)
            except PairAgain:
                conn = self._connect(endpoint)
            with self._lock:
                if self._closed:
                    conn.break_(KVTransferError("aborted", "the KV sender is closed"))
                    raise conn.broken
                self._conns[endpoint] = conn
            return conn

    def _connect(self, endpoint: str) -> Connection:
        host, port = parse_endpoint(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        except OSError as e:
            raise KVTransferError("unreachable", f"cannot connect to decode KV endpoint {endpoint}: {e}") from None
        try:
            configure_socket(sock)
            send_frame(sock, {"kind": HELLO, "version": VERSION, "layout": self.layout.to_dict(),
                              "token": self.token or "", **self.pairing.hello(endpoint)})
            reply = recv_frame(sock, _MAX_REPLY_PAYLOAD)
            if reply is None:
                raise ConnectionError("it closed the connection")
            if reply[0]["kind"] == HELLO_ERROR:
                kind = "unauthenticated" if reply[0].get("error_kind") == "unauthenticated" else "incompatible"
                raise KVTransferError(kind, f"decode KV endpoint {endpoint} refused this prefill "
                                            f"worker: {reply[0].get('message')}")
            if reply[0]["kind"] != HELLO_OK:
                raise ProtocolError(f"unexpected {reply[0]['kind']} frame")
            sock.settimeout(None)  # before the connection's reader starts: an idle link is not an error
            return Connection(endpoint, sock, self.pairing.open(endpoint, sock, reply[0]), self.checksum)
        except OSError as e:
            sock.close()
            raise KVTransferError("unreachable", f"decode KV endpoint {endpoint} did not complete the handshake "
                                                 f"within {self.connect_timeout_s:g} s: {e}") from None
        except ProtocolError as e:
            sock.close()
            raise KVTransferError("protocol", f"decode KV endpoint {endpoint} is not a pdserve KV endpoint: {e}") \
                from None
        except KVTransferError:
            sock.close()
            raise
