"""Decode side of "cuda_ipc" and "auto": the TCP receiver, whose HELLO_OK hands a same-node prefill worker an IPC
handle to the decode pool; that sender then writes the rows into the reserved pages itself.

Per connection the handshake picks a mode (`choose_transport`): "tcp" (frames carry the rows, written here as
the TCP receiver does) or "cuda_ipc". A cuda_ipc room goes:

    BEGIN {room, num_layers, pages} ->        checked against the reservation (pages, layers): nothing of the
                                               peer's is written anywhere before this answer
    <- GRANT {room, num_tokens}                from now on the sender may write into those pages
    LAYER {room, layer | layers, num_tokens} -> the device copy of layer k (or of the run of layers: the
                                               prefill engine sends a prompt's layers in one) is queued behind
                                               its forward; as many as it takes to cover every layer
    AUX {...} ->                               sent once the sender saw all its copies complete: on_layer for
                                               each layer, then on_done
    ABORT {room} ->                            the sender failed or dropped the room *and* saw its copies complete

A granted room that fails here (cancel, timeout, a bad frame) is *draining*: the sender is told (ROOM_FAILED),
stops writing, and answers ABORT once its copies have completed; only then are its pages released (on_failed, or
False from cancel()). A sender that does not answer within `drain_timeout_s`, or whose connection ends, ends the
pairing: its connection is closed, and the prefill worker drops its mapping after its stream has drained.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Optional, Sequence

import torch

from .base import KVLayout, KVTransferError, TransferState
from .cuda_ipc_pairing import AUTO, IPC, TCP, Facts, IpcBackend, choose_transport
from .tcp_receiver import TcpKVReceiver, _is_int, _PeerConn, _Room
from .wire import ABORT, AUX, LAYER, ProtocolError

logger = logging.getLogger(__name__)

BEGIN, GRANT = "BEGIN", "GRANT"


class _IpcPeer(_PeerConn):
    def __init__(self, sock: socket.socket, addr: str):
        super().__init__(sock, addr)
        self.mode, self.reason = TCP, ""
        self.export: Optional[dict[str, Any]] = None


class _IpcRoom(_Room):
    def __init__(self, room: int, num_tokens: int, dst_slots: torch.Tensor, num_layers: int, deadline: float,
                 pages: list[int]):
        super().__init__(room, num_tokens, dst_slots, num_layers, deadline)
        self.pages = pages
        self.granted = False  # the sender may be writing into its pages
        self.announced: list[int] = []  # layers in the order the sender queued them
        self.owed: Optional[tuple[str, str]] = None  # the on_failed delivered once the sender released the pages
        self.drain_deadline = 0.0


class CudaIpcKVReceiver(TcpKVReceiver):
    """See `KVReceiver`. `kv_buffer` (required): the decode pool `(num_layers, num_slots, kv_dim)`. `ipc`: the GPU
    facts and calls (`IpcBackend`; the CPU tests pass fakes). `drain_timeout_s`: how long a failed, granted room
    waits for its sender's release before the pairing is torn down."""

    transport = IPC
    peer_conn_cls = _IpcPeer
    data_kinds = (LAYER, AUX, ABORT, BEGIN)

    def __init__(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, *,
                 kv_buffer: Optional[torch.Tensor], ipc: Optional[IpcBackend] = None, drain_timeout_s: float = 5.0,
                 **options: Any):
        if kv_buffer is None:
            raise ValueError(f"the {self.transport} KV receiver writes into the decode pool: pass kv_buffer")
        self._ipc = ipc or IpcBackend()
        self._kv = kv_buffer
        self._facts = self._ipc.local_facts(kv_buffer.device)
        self._export_problem = self._ipc.export_problem(kv_buffer)
        self._export: Optional[dict[str, Any]] = None
        if self._export_problem is None:
            # NOTE: once, here, before the decode engine runs anything on the pool: torch's export re-wraps the
            # storage's data pointer (same address) in its IPC reference counting; every pairing gets these fields.
            try:
                self._export = self._ipc.export(kv_buffer)
            except (RuntimeError, ValueError, TypeError) as e:
                self._export_problem = f"exporting the decode pool over CUDA IPC failed: {e}"
        if self.transport == IPC and self._export_problem:
            raise ValueError(f"--kv-transport cuda_ipc: {self._export_problem} (or use --kv-transport auto/tcp)")
        self._drain_timeout_s = drain_timeout_s
        self._draining: dict[int, _IpcRoom] = {}
        super().__init__(layout, host, port, kv_buffer=kv_buffer, **options)

    # ---- public API ----

    def cancel(self, room: int) -> bool:
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return False
            granted = r.granted  # the sender may be writing into its pages: they are freed on on_failed
            self._drop_locked(r, "aborted", f"room {room} was cancelled by the decode worker", callback=granted)
            return not granted

    def close(self) -> None:
        super().close()
        with self._lock:  # the connections are down: rooms still waiting for their sender's release go now
            for r in list(self._draining.values()):
                self._release_locked(r)

    def transport_of(self, room: int) -> str:
        """The transport a pending room's rows travel over (its pairing's; "" before a sender touched it)."""
        with self._lock:
            r = self._rooms.get(room)
            return r.conn.mode if r is not None and r.conn is not None else ""

    # ---- hooks of the TCP receiver ----

    def _new_room(self, room: int, num_tokens: int, dst_pages: Sequence[int], slots: torch.Tensor, num_layers: int,
                  deadline: float) -> _IpcRoom:
        if room in self._draining:
            raise ValueError(f"room {room} is still draining its previous transfer")
        if int(slots.max()) >= self._kv.shape[1]:
            raise ValueError(f"dst_pages reach slot {int(slots.max())}; kv_buffer has {self._kv.shape[1]} slots")
        return _IpcRoom(room, num_tokens, slots, num_layers, deadline, [int(p) for p in dst_pages])

    def _transport_problem(self, conn: _IpcPeer, header: dict[str, Any]) -> Optional[str]:
        wants = header.get("transport", TCP)
        try:
            facts = Facts.from_dict(header["ipc_facts"]) if "ipc_facts" in header else None
        except ValueError as e:
            return f"bad HELLO: {e}"
        mode, why = choose_transport(wants, self.transport, facts, self._facts, self._export_problem)
        conn.export = self._export if mode == IPC else None
        if mode is None:
            return why
        conn.mode, conn.reason = mode, why
        logger.info("KV receiver %s paired with prefill %s over %s (%s)", self.endpoint, conn.addr, mode, why)
        return None

    def _room_error(self, r: _IpcRoom, kind: str, message: str) -> KVTransferError:
        error = super()._room_error(r, kind, message)
        error.transport = r.conn.mode if r.conn is not None else self.transport
        return error

    def _hello_ok(self, conn: _IpcPeer) -> dict[str, Any]:
        return {"transport": conn.mode, "reason": conn.reason, **({"ipc": conn.export} if conn.mode == IPC else {})}

    def _disconnected(self, conn: _IpcPeer) -> None:
        # Its rooms already failed (the base class): the draining ones are released now. NOTE: a sender whose
        # process died took its queued copies with its CUDA context; one that is alive stops writing when its
        # connection breaks and drains its stream before it drops the mapping.
        with self._lock:
            for r in [r for r in self._draining.values() if r.conn is conn]:
                self._release_locked(r)

    def _drop_locked(self, r: _IpcRoom, kind: str, message: str, notify: bool = True, callback: bool = True) -> None:
        if callback and notify and r.granted and not r.status.finished:
            # NOTE: the sender may still have copies queued into its pages: released on its ABORT (or teardown).
            r.owed, r.drain_deadline = (kind, message), time.monotonic() + self._drain_timeout_s
            self._draining[r.room] = r
            callback = False
        super()._drop_locked(r, kind, message, notify=notify, callback=callback)

    def _release_locked(self, r: _IpcRoom) -> None:
        if self._draining.pop(r.room, None) is r:
            self._call(self._on_failed, r.room, self._room_error(r, *r.owed))

    def _on_tick_locked(self, now: float) -> None:
        for r in [r for r in self._draining.values() if now >= r.drain_deadline]:
            r.drain_deadline = float("inf")  # torn down once; the connection's end releases the room
            logger.warning("KV receiver %s: prefill %s did not release room %d within %g s; closing the pairing",
                           self.endpoint, r.conn.addr, r.room, self._drain_timeout_s)
            try:
                r.conn.sock.shutdown(socket.SHUT_RDWR)  # its thread ends and calls _disconnected
            except OSError:
                pass

    def _complete_if_ready_locked(self, r: _IpcRoom) -> None:
        if isinstance(r, _IpcRoom) and r.granted and len(r.layers) == r.num_layers and r.aux is not None:
            # The sender saw every copy complete before it sent AUX: the layers have landed.
            for layer in r.announced:
                if not self._call(self._on_layer, r.room, layer, r.dst_slots, None):
                    self._drop_locked(r, "aborted", f"room {r.room}: the decode worker's on_layer callback raised",
                                      notify=True, callback=True)
                    self._release_locked(r)  # nothing writes any more: AUX came after the last copy
                    return
        super()._complete_if_ready_locked(r)

    def _on_data(self, conn: _IpcPeer, kind: str, header: dict[str, Any], payload: torch.Tensor) -> None:
        if conn.mode == TCP:
            if kind == BEGIN:
                raise ProtocolError("BEGIN on a tcp pairing")
            return super()._on_data(conn, kind, header, payload)
        room = header.get("room")
        if not _is_int(room):
            raise ProtocolError(f"{kind} frame without an integer room: {str(header)[:200]}")
        if kind == LAYER and payload.numel():
            raise ProtocolError("a cuda_ipc LAYER frame carries no rows")
        with self._lock:
            drained = self._draining.get(room)
            if drained is not None and drained.conn is conn:
                if kind == ABORT:  # the sender's copies of the room completed: its pages may go
                    self._release_locked(drained)
                return  # frames it queued before it learned the room failed
            r = self._rooms.get(room)
            if r is None:
                self._refuse_unknown_locked(conn, kind, room)
                return
            if r.conn is not None and r.conn is not conn:
                raise ProtocolError(f"{kind} frame for room {room}, which another connection is sending")
            if kind == BEGIN:
                return self._begin_locked(conn, r, header)
            if kind == ABORT:
                return super()._on_data(conn, kind, header, payload)
            if not r.granted:
                raise ProtocolError(f"{kind} frame for room {room} before its BEGIN was granted")
            if kind == AUX:
                return super()._on_data(conn, kind, header, payload)
            # One layer ("layer") or several copied at once ("layers": a prompt's whole run, see send_layers).
            layers, n = header["layers"] if "layers" in header else [header.get("layer")], header.get("num_tokens")
            if (not isinstance(layers, list) or not layers
                    or not all(_is_int(layer) and 0 <= layer < r.num_layers and layer not in r.layers
                               for layer in layers) or len(set(layers)) != len(layers) or n != r.num_tokens):
                # Copies stayed inside the granted pages; the sender just disagrees about the room: fail it only.
                self._drop_locked(r, "protocol", f"room {room}: bad LAYER announcement (layers {str(layers)[:80]} "
                                                 f"of {r.num_layers}, {n!r} tokens, {r.num_tokens} expected)")
                return
            r.layers.update(layers)
            r.announced.extend(layers)

    def _begin_locked(self, conn: _IpcPeer, r: _IpcRoom, header: dict[str, Any]) -> None:
        if r.granted:
            raise ProtocolError(f"BEGIN for room {r.room} twice")
        pages, num_layers = header.get("pages"), header.get("num_layers")
        need = -(-r.num_tokens // self.layout.page_size)
        r.conn = conn
        if not (isinstance(pages, list) and all(_is_int(p) for p in pages)) or pages[:need] != r.pages[:need] \
                or len(pages) < need or num_layers != r.num_layers:
            self._drop_locked(r, "protocol", f"room {r.room}: prefill would write {num_layers!r} layers into pages "
                                             f"{str(pages)[:80]}, this decode worker reserved {r.num_layers} layers "
                                             f"in {r.pages[:need]}")
            return
        r.granted = True
        r.status.advance(TransferState.TRANSFERRING)
        self._outbox.put((conn, {"kind": GRANT, "room": r.room, "num_tokens": r.num_tokens}))


class AutoKVReceiver(CudaIpcKVReceiver):
    """"auto": cuda_ipc with senders that can map the pool, tcp with the others (see `choose_transport`)."""

    transport = AUTO
