"""Prefill side of the TCP KV transport: one connection per decode endpoint, shared by all rooms sent there.

Threads per connection (daemons): a writer that drains the connection's frame queue (so `send_layer` returns
at once and the next layer's forward overlaps the transfer) and a reader that applies the decode worker's
ROOM_DONE / ROOM_FAILED answers and notices a dead connection.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any, Callable, Sequence

import torch

from .base import (
    ERROR_KINDS, KVLayout, KVSender, KVTransferError, SendHandle, TransferState, TransferStats, TransferStatus,
    dtype_name, gather_rows,
)
from .wire import (
    ABORT, AUX, HELLO, HELLO_ERROR, HELLO_OK, LAYER, ROOM_DONE, ROOM_FAILED, VERSION, ProtocolError,
    configure_socket, encode_frame, frame_nbytes, parse_endpoint, payload_crc32, recv_frame, send_frame,
    tensor_bytes, write_frame,
)

# The decode side only ever answers with payload-free frames.
_MAX_REPLY_PAYLOAD = 0


class _Connection:
    transport = "tcp"  # what the rows travel over (the `transport` label of the transfer metrics)

    def __init__(self, endpoint: str, sock: socket.socket, checksum: bool = True):
        self.endpoint, self.sock, self.checksum = endpoint, sock, checksum
        self.lock = threading.Lock()
        self.handles: dict[int, TcpSendHandle] = {}
        self.broken: KVTransferError | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # (handle, frame kind, frame buffers) or None
        self._copy_stream = None  # device-to-host copies of rows on a CUDA pool
        self.writer = threading.Thread(target=self._write_loop, name=f"kv-send-w-{endpoint}", daemon=True)
        self.reader = threading.Thread(target=self._read_loop, name=f"kv-send-r-{endpoint}", daemon=True)
        self.writer.start()
        self.reader.start()

    def copy_stream(self, device: torch.device):
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        return self._copy_stream

    def register(self, handle: TcpSendHandle) -> bool:
        with self.lock:
            if self.broken is not None:
                return False
            if handle.room in self.handles:
                raise ValueError(f"room {handle.room} is already being sent to {self.endpoint}")
            self.handles[handle.room] = handle
            return True

    def unregister(self, handle: TcpSendHandle) -> None:
        with self.lock:
            if self.handles.get(handle.room) is handle:
                del self.handles[handle.room]

    def put(self, handle: TcpSendHandle, kind: str, header: dict[str, Any], *payload: memoryview | bytes,
            post: Callable[[], None] | None = None) -> None:
        """Queue one frame. `post`, if given, runs on the writer thread right after the frame is written: the
        collective transports post a layer's sends there, so announcements and sends leave in one order."""
        self.queue.put((handle, kind, self._frame(handle, kind, header, *payload), post))

    def put_when_ready(self, handle: TcpSendHandle, kind: str, header: dict[str, Any], rows: torch.Tensor,
                       ready: Any) -> None:
        """Queue a frame whose payload `rows` (pinned host memory) a device copy is still filling; `ready`, a CUDA
        event, marks it done. The writer thread waits for it, then checksums and encodes: the caller (the prefill
        engine's thread) never waits for the device, so the forward's next layers are queued at once."""
        def build() -> list[bytes | memoryview]:
            ready.synchronize()
            return self._frame(handle, kind, header, tensor_bytes(rows))

        self.queue.put((handle, kind, build, None))

    def _frame(self, handle: TcpSendHandle, kind: str, header: dict[str, Any], *payload: memoryview | bytes):
        if self.checksum and kind in (LAYER, AUX) and payload:
            # NOTE: over rows already in host memory (a few GB/s, cheap next to the forward that produced them).
            header = {**header, "crc32": payload_crc32(*payload)}
        frame = encode_frame({"kind": kind, "room": handle.room, **header}, *payload)
        handle._bytes += frame_nbytes(frame)
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

    def _write_loop(self) -> None:
        while (item := self.queue.get()) is not None:
            handle, kind, frame, post = item
            if kind != ABORT and handle.status.state == TransferState.FAILED:
                continue  # the room is dead: drop its remaining frames so the link is free for the others
            if callable(frame):  # rows still on their way off the GPU (put_when_ready)
                try:
                    frame = frame()
                except RuntimeError as e:  # a CUDA error: this room's rows cannot be read
                    handle._fail("aborted", f"room {handle.room}: reading its rows off the GPU failed: {e}")
                    continue
                if frame is None:  # the builder failed the room itself
                    continue
            try:
                write_frame(self.sock, frame)
            except OSError as e:
                self.break_(KVTransferError("peer_failed", f"sending to decode KV endpoint {self.endpoint} "
                                                           f"failed: {e}"))
                return
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
                    if not self._on_reply(header, handle):
                        raise ProtocolError(f"unexpected {header['kind']} frame")
                    continue
                if handle is None:
                    continue  # the room already finished here (aborted or timed out locally)
                if header["kind"] == ROOM_DONE:
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
        self._ended()

    def _on_reply(self, header: dict[str, Any], handle: TcpSendHandle | None) -> bool:
        """A reply other than ROOM_DONE/ROOM_FAILED (on the reader thread); False: not one this transport knows."""
        return False

    def _ended(self) -> None:
        """Both threads are done: release what the transport holds for this connection."""


class TcpSendHandle(SendHandle):
    """See `SendHandle`. Use one handle from one thread; different handles may be used from different threads."""

    def __init__(self, conn: _Connection, room: int, num_layers: int, layout: KVLayout, timeout_s: float):
        self.room, self.num_layers, self.layout = room, num_layers, layout
        self.status = TransferStatus(TransferState.BOOTSTRAPPING)
        self._conn, self._timeout_s = conn, timeout_s
        self.transport = conn.transport
        self._layers: set[int] = set()
        self._num_tokens: int | None = None
        self._finished = False
        self._bytes = 0
        self._event = threading.Event()
        self._t0 = time.monotonic()
        self._t_rows: float | None = None  # the first rows' hand-over: a transfer's time runs from there
        self._t_end: float | None = None
        self._deadline = self._t0 + timeout_s

    def send_rows(self, layer: int, source: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        num_tokens = self._check_layer(layer, source, slots)
        self._num_tokens = num_tokens
        self._layers.add(layer)
        self._t_rows = self._t_rows or time.monotonic()
        if self.status.state == TransferState.FAILED:
            return
        self._queue_layer(layer, source, slots)

    def _check_layer(self, layer: int, source: torch.Tensor, slots: torch.Tensor | None) -> int:
        """Argument mistakes raise ValueError before anything is queued; returns the layer's token count."""
        if self._finished:
            raise ValueError(f"room {self.room}: send_layer({layer}) after finish()")
        if not 0 <= layer < self.num_layers or layer in self._layers:
            raise ValueError(f"room {self.room}: layer {layer} is out of range [0, {self.num_layers}) or repeated")
        num_tokens = source.shape[0] if slots is None else slots.numel()
        if source.dim() != 2 or source.shape[1] != self.layout.kv_dim or num_tokens == 0:
            raise ValueError(f"room {self.room}: values of shape {tuple(source.shape)}, expected "
                             f"(num_tokens > 0, kv_dim={self.layout.kv_dim})")
        if slots is not None and slots.dim() != 1:
            raise ValueError(f"room {self.room}: slots of shape {tuple(slots.shape)}, expected (num_tokens,)")
        if source.dtype != self.layout.torch_dtype:
            raise ValueError(f"room {self.room}: values are {source.dtype}, the layout says {self.layout.dtype}")
        if self._num_tokens is not None and num_tokens != self._num_tokens:
            raise ValueError(f"room {self.room}: layer {layer} has {num_tokens} tokens, earlier layers "
                             f"{self._num_tokens}")
        return num_tokens

    def _check_layers(self, first_layer: int, source: torch.Tensor, slots: torch.Tensor | None) -> list[int]:
        """`send_layers`' arguments checked (every layer, before any change), then the layers taken; returns them."""
        layers = list(range(first_layer, first_layer + source.shape[0]))
        if source.dim() != 3 or not layers:
            raise ValueError(f"room {self.room}: send_layers takes (num_layers > 0, slots or tokens, kv_dim), got "
                             f"{tuple(source.shape)}")
        counts = {self._check_layer(layer, source[layer - first_layer], slots) for layer in layers}
        self._num_tokens = counts.pop()  # (one count: the slots are shared)
        self._layers.update(layers)
        self._t_rows = self._t_rows or time.monotonic()
        return layers

    def _queue_layer(self, layer: int, source: torch.Tensor, slots: torch.Tensor | None) -> None:
        header = {"layer": layer, "num_tokens": self._num_tokens}
        if source.device.type != "cuda":
            # NOTE: gathered here, so the caller may overwrite or free the source pages as soon as this returns.
            self._conn.put(self, LAYER, header, tensor_bytes(gather_rows(source, slots, "cpu")))
            return
        # Gathered on the caller's stream (ordered after the forward that wrote the layer and before anything
        # that overwrites it), then copied to pinned host memory on a side stream without waiting for it.
        rows = gather_rows(source, slots, source.device)  # (num_tokens, kv_dim)
        copy_stream = self._conn.copy_stream(source.device)
        copy_stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(copy_stream):
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(copy_stream)
        rows.record_stream(copy_stream)  # the allocator must not hand its memory out before the copy read it
        self._conn.put_when_ready(self, LAYER, header, host, ready)

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
        payload = [rng]
        if hidden is not None:
            h = hidden.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            header.update(hidden_dtype=dtype_name(h.dtype), hidden_shape=list(h.shape),
                          hidden_nbytes=h.numel() * h.element_size())
            payload.insert(0, tensor_bytes(h))
        if self.status.state != TransferState.FAILED:
            self._queue_aux(header, payload)
        self._finished = True

    def _queue_aux(self, header: dict[str, Any], payload: list[bytes | memoryview]) -> None:
        self._conn.put(self, AUX, header, *payload)

    def wait(self, timeout: float | None = None) -> TransferStats:
        limit = self._deadline - time.monotonic() if timeout is None else timeout
        if not self._event.wait(max(0.0, limit)):
            self._expire(self._timeout_s if timeout is None else timeout)
        error = self.status.exception()
        if error is not None:
            raise error
        return TransferStats(self._bytes, self._t_end - (self._t_rows or self._t0))

    def poll(self) -> TransferState:
        if not self.status.finished and time.monotonic() >= self._deadline:
            self._expire(self._timeout_s)
        return self.status.state

    def abort(self) -> None:
        if self._fail("aborted", f"room {self.room} was aborted by the prefill worker"):
            self._conn.put(self, ABORT, {})

    def _expire(self, seconds: float) -> None:
        if self._fail("timeout", f"room {self.room}: decode KV endpoint {self._conn.endpoint} did not confirm "
                                 f"the transfer within {seconds:g} s"):
            self._conn.put(self, ABORT, {})  # let the decode worker release the pages now, not at its deadline

    # ---- called by the connection's threads ----

    def _complete(self) -> None:
        if self.status.advance(TransferState.DONE):
            self._t_end = time.monotonic()
            self._conn.unregister(self)
            self._event.set()

    def _fail(self, kind: str, message: str) -> bool:
        if not self.status.fail(kind, message):
            return False
        self._t_end = time.monotonic()
        self._conn.unregister(self)
        self._event.set()
        return True


class TcpKVSender(KVSender):
    """See `KVSender`. Connections are made on first use per endpoint, reused, and remade once broken.
    `token`: the shared internal token the decode receivers require (None: send none). `checksum`: send a CRC32
    of every LAYER/AUX payload (the receiver fails a room whose data does not match). `device`: where the rows
    live (TCP copies them to the host whatever it is, so it only matters to the collective transports)."""

    transport = "tcp"  # announced in HELLO: a decode worker on another transport refuses the pairing

    def __init__(self, layout: KVLayout, connect_timeout_s: float = 5.0, timeout_s: float = 300.0,
                 token: str | None = None, checksum: bool = True, device: torch.device | str | None = None):
        self.layout, self.connect_timeout_s, self.timeout_s = layout, connect_timeout_s, timeout_s
        self.token, self.checksum = token, checksum
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._lock = threading.Lock()
        self._conns: dict[str, _Connection] = {}
        self._connect_locks: dict[str, threading.Lock] = {}
        self._closed = False

    def begin(self, endpoint: str, room: int, num_layers: int,
              dst_pages: Sequence[int] | None = None) -> TcpSendHandle:
        self._check_room(room, num_layers)
        for _ in range(2):  # a connection that broke between lookup and registration is remade once
            conn = self._connection(endpoint)
            handle = self._start(conn, room, num_layers, dst_pages)
            if handle is not None:
                return handle
        raise conn.broken

    def begin_if_paired(self, endpoint: str, room: int, num_layers: int,
                        dst_pages: Sequence[int] | None = None) -> TcpSendHandle | None:
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

    def _start(self, conn: _Connection, room: int, num_layers: int,
               dst_pages: Sequence[int] | None) -> TcpSendHandle | None:
        """The room's handle on `conn`, registered; None when the connection broke meanwhile."""
        handle = self._new_handle(conn, room, num_layers, dst_pages)
        if not conn.register(handle):
            return None
        handle.status.advance(TransferState.TRANSFERRING)
        return handle

    def _new_handle(self, conn: _Connection, room: int, num_layers: int,
                    dst_pages: Sequence[int] | None) -> TcpSendHandle:
        return TcpSendHandle(conn, room, num_layers, self.layout, self.timeout_s)  # rows carry no destination

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.break_(KVTransferError("aborted", "the KV sender was closed"))
        for c in conns:
            c.reader.join(timeout=2.0)

    def _connection(self, endpoint: str) -> _Connection:
        with self._lock:
            if self._closed:
                raise KVTransferError("aborted", "the KV sender is closed")
            connect_lock = self._connect_locks.setdefault(endpoint, threading.Lock())
        with connect_lock:  # one handshake per endpoint at a time; other endpoints are not held up
            conn = self._conns.get(endpoint)
            if conn is not None and conn.broken is None:
                return conn
            conn = self._connect(endpoint)
            with self._lock:
                if self._closed:
                    conn.break_(KVTransferError("aborted", "the KV sender is closed"))
                    raise conn.broken
                self._conns[endpoint] = conn
            return conn

    def _hello_fields(self, endpoint: str) -> dict[str, Any]:
        """What HELLO says about this side beyond the layout and token."""
        return {"transport": self.transport}

    def _open(self, endpoint: str, sock: socket.socket, hello_ok: dict[str, Any]) -> _Connection:
        """The connection over a handshaken socket (the collective transports set up their process group here).
        Raises KVTransferError; the caller closes the socket."""
        return _Connection(endpoint, sock, self.checksum)

    def _connect(self, endpoint: str) -> _Connection:
        host, port = parse_endpoint(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        except OSError as e:
            raise KVTransferError("unreachable", f"cannot connect to decode KV endpoint {endpoint}: {e}") from None
        try:
            configure_socket(sock)
            send_frame(sock, {"kind": HELLO, "version": VERSION, "layout": self.layout.to_dict(),
                              "token": self.token or "", **self._hello_fields(endpoint)})
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
            conn = self._open(endpoint, sock, reply[0])
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
        return conn
