"""Decode side of the collective KV transports: the TCP receiver's control channel (handshake, AUX, ABORT, room
deadlines, notifier) plus, per sender connection, a process group whose receives land straight in the decode pool.

The receiver hosts a `TCPStore`; HELLO_OK names it and a fresh group id, and both sides join that group (the
connection thread here, `_open` on the sender). Each LAYER announcement names a layer or a run of layers and the
token count: one op carries their rows as one contiguous block. The connection thread, which reads announcements in
order, posts one receive into a staging block on the pool's device under the receiver lock, and behind it, on the
pair's stream, the scatter of the block into the room's reserved pages (`pages.py`). A room the receiver no longer
wants (cancelled, timed out, aborted, unknown) still gets its announced ops received, into scratch: the op streams
of both sides never diverge, so one room's failure costs the pair nothing.

A room that fails while receives are landing in its pages is *draining*: it is gone for the sender at once (it is
told), but its pages are not released (on_failed, or False from cancel()) until those receives resolved. A room
still draining `drain_timeout_s` later means the pair's op stream is stuck: the pair is torn down (its control
connection closed, its group aborted), which resolves every op; the sender reconnects with a new group.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
import uuid
from functools import partial
from typing import Any, Optional, Sequence

import torch

from .base import KVLayout, KVTransferError, TransferState
from .collective_pair import BACKENDS, DECODE_RANK, ProcessGroupPair
from .pages import PagePlan, plan_pages, scatter_pages
from .tcp_receiver import TcpKVReceiver, _is_int, _PeerConn, _Room
from .wire import LAYER, ProtocolError

logger = logging.getLogger(__name__)


class _PairedPeer(_PeerConn):
    def __init__(self, sock: socket.socket, addr: str):
        super().__init__(sock, addr)
        self.group_id = uuid.uuid4().hex  # unguessable: the store is open, the group name is only told after HELLO
        self.pair: Optional[ProcessGroupPair] = None


class _PoolRoom(_Room):
    def __init__(self, room: int, num_tokens: int, dst_slots: torch.Tensor, num_layers: int, deadline: float,
                 dst_pages: list[int], ready: Any):
        super().__init__(room, num_tokens, dst_slots, num_layers, deadline)
        self.dst_pages = dst_pages
        self.plan: Optional[PagePlan] = None  # made on the pair's stream at the first scatter, used only there
        self.ready = ready  # event after the compute queued before expect(): the pages' last readers
        self.posted: set[int] = set()  # layers whose receives were posted
        self.inflight = 0  # ops posted and not yet resolved
        self.owed: Optional[tuple[str, str]] = None  # (kind, message) of the on_failed delivered once drained
        self.drain_deadline = 0.0


class CollectiveKVReceiver(TcpKVReceiver):
    """See `KVReceiver`; a subclass sets `transport` to a backend of `BACKENDS`. `kv_buffer` (required): the
    decode pool `(num_layers, num_slots, kv_dim)`, contiguous, of the layout's dtype, on the backend's device type.
    `drain_timeout_s`: how long a failed room may wait for receives already landing in its pages before its pair
    is torn down."""

    peer_conn_cls = _PairedPeer

    def __init__(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, *, kv_buffer: torch.Tensor | None,
                 drain_timeout_s: float = 5.0, handshake_timeout_s: float = 10.0, **options: Any):
        self.backend = BACKENDS[self.transport]
        _check_kv_buffer(kv_buffer, layout, self.transport, self.backend.device_type)
        self._kv = kv_buffer
        self._drain_timeout_s = drain_timeout_s
        self._draining: dict[int, _PoolRoom] = {}
        import torch.distributed as dist

        # NOTE: before the base class starts accepting: its threads call the hooks below.
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=handshake_timeout_s))
        super().__init__(layout, host, port, handshake_timeout_s=handshake_timeout_s, kv_buffer=kv_buffer,
                         **options)

    def cancel(self, room: int) -> bool:
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return False
            callback = r.inflight > 0  # receives are landing in its pages: the caller frees them on on_failed
            self._drop_locked(r, "aborted", f"room {room} was cancelled by the decode worker", callback=callback)
            return not callback

    def close(self) -> None:
        super().close()
        self._store = None  # stops the store's server

    # ---- hooks of the TCP receiver ----

    def _new_room(self, room: int, num_tokens: int, dst_pages: Sequence[int], slots: torch.Tensor, num_layers: int,
                  deadline: float) -> _PoolRoom:
        if room in self._draining:
            raise ValueError(f"room {room} is still draining its previous transfer")
        if int(slots.max()) >= self._kv.shape[1]:
            raise ValueError(f"dst_pages reach slot {int(slots.max())}; kv_buffer has {self._kv.shape[1]} slots")
        return _PoolRoom(room, num_tokens, slots, num_layers, deadline, list(dst_pages),
                         self.backend.ready_event(self._kv.device))

    def _hello_ok(self, conn: _PairedPeer) -> dict[str, Any]:
        host = conn.sock.getsockname()[0]  # the address this sender reached us on
        host = f"[{host}]" if ":" in host else host
        return {"store": f"{host}:{self._store.port}", "group": conn.group_id}

    def _paired(self, conn: _PairedPeer) -> bool:
        local_host = conn.sock.getsockname()[0]
        try:
            conn.pair = ProcessGroupPair.connect(
                self.backend, (local_host, self._store.port), conn.group_id, DECODE_RANK, local_host=local_host,
                device=self._kv.device, connect_timeout_s=self.handshake_timeout_s, op_timeout_s=self.timeout_s,
                name=f"decode<-{conn.addr}")
        except (RuntimeError, ValueError) as e:
            logger.warning("KV receiver %s: no %s process group with prefill %s: %s", self.endpoint, self.transport,
                           conn.addr, e)
            return False
        conn.pair.on_broken = partial(self._teardown, conn)
        return True

    def _disconnected(self, conn: _PairedPeer) -> None:
        if conn.pair is not None:
            conn.pair.close(f"the control connection from prefill {conn.addr} ended")

    def _drop_locked(self, r: _PoolRoom, kind: str, message: str, notify: bool = True, callback: bool = True) -> None:
        if callback and r.inflight and not r.status.finished:
            # NOTE: its pages are still being written: the owner may only free them once the receives resolved.
            r.owed, r.drain_deadline = (kind, message), time.monotonic() + self._drain_timeout_s
            self._draining[r.room] = r
            callback = False
        super()._drop_locked(r, kind, message, notify=notify, callback=callback)

    def _on_tick_locked(self, now: float) -> None:
        for r in [r for r in self._draining.values() if now >= r.drain_deadline]:
            r.drain_deadline = float("inf")  # torn down once; the teardown resolves its receives
            reason = (f"room {r.room} still had {r.inflight} layer(s) landing {self._drain_timeout_s:g} s after it "
                      "failed")
            # Off the timer thread: aborting a communicator may take a while, and the lock is held here.
            threading.Thread(target=self._teardown, args=(r.conn, reason), name="kv-recv-teardown",
                             daemon=True).start()

    def _on_data(self, conn: _PairedPeer, kind: str, header: dict[str, Any], payload: torch.Tensor) -> None:
        if kind != LAYER:
            return super()._on_data(conn, kind, header, payload)
        room, n = header.get("room"), header.get("num_tokens")
        layers = header.get("layers", [header.get("layer")])
        if not (_is_int(room) and _is_int(n) and 0 < n <= self._max_room_tokens and isinstance(layers, list)
                and 0 < len(layers) <= self.layout.num_kv_layers and all(_is_int(x) for x in layers)
                and payload.numel() == 0):
            # Without a trustworthy block size there is no knowing what the sender's op carries (and nothing larger
            # than a room of every layer is allocated for it).
            raise ProtocolError(f"LAYER announcement without a valid room, layers and token count: "
                                f"{str(header)[:200]}")
        block = torch.empty(len(layers), n, self.layout.kv_dim, dtype=self._kv.dtype, device=self._kv.device)
        with self._lock:
            r, ok = self._rooms.get(room), False
            if r is None:
                self._refuse_unknown_locked(conn, kind, room)
            else:
                if r.conn is not None and r.conn is not conn:
                    raise ProtocolError(f"LAYER for room {room}, which another connection is sending")
                r.conn = conn
                try:
                    self._check_announcement(r, layers, n)
                    ok = True
                except ValueError as e:
                    self._drop_locked(r, "protocol", f"room {room}: bad LAYER announcement: {e}")
                    raise ProtocolError(f"bad LAYER announcement for room {room}: {e}") from None
            if not ok:  # received and dropped, so the next announcement's op lines up
                self._post(conn, [block])
                return
            self._post(conn, [block], r.ready, partial(self._landed, r, layers),
                       then=partial(self._scatter, r, layers, block))
            r.status.advance(TransferState.TRANSFERRING)
            r.posted.update(layers)
            r.inflight += 1

    def _scatter(self, r: _PoolRoom, layers: list[int], block: torch.Tensor) -> None:
        """On the pair's stream, behind the block's receive: the block into the room's pages of its layers."""
        if r.plan is None:
            r.plan = plan_pages(r.dst_pages, r.num_tokens, self.layout.page_size, self._kv.device)
        scatter_pages(self._kv[layers[0]:layers[-1] + 1], block, r.plan)

    @staticmethod
    def _post(conn: _PairedPeer, buffers: list[torch.Tensor], after: Any = None, on_complete=None,
              then=None) -> None:
        try:
            conn.pair.post(buffers, send=False, after=after, on_complete=on_complete, then=then)
        except RuntimeError as e:
            raise ConnectionError(f"posting receives failed: {e}") from None  # ends the connection: peer_failed

    @staticmethod
    def _check_announcement(r: _PoolRoom, layers: list[int], n: int) -> None:
        if layers != list(range(layers[0], layers[0] + len(layers))):
            raise ValueError(f"layers {layers[:8]} are not a run of consecutive layers")
        if not (0 <= layers[0] and layers[-1] < r.num_layers):
            raise ValueError(f"layers {layers[0]}-{layers[-1]} are outside the room's {r.num_layers} layers")
        if r.posted.intersection(layers):
            raise ValueError(f"layer {min(r.posted.intersection(layers))} arrived twice")
        if n != r.num_tokens:
            raise ValueError(f"prefill sent {n!r} tokens, decode expected {r.num_tokens}")

    # ---- the pair's reaper thread ----

    def _landed(self, r: _PoolRoom, layers: list[int], error: Optional[str]) -> None:
        with self._lock:
            r.inflight -= 1
            if self._draining.get(r.room) is r:
                if r.inflight == 0:
                    del self._draining[r.room]
                    self._call(self._on_failed, r.room, KVTransferError(*r.owed))
                return
            if self._rooms.get(r.room) is not r:
                return
            if error is not None:
                self._drop_locked(r, "peer_failed", f"room {r.room}: receiving layers {layers[0]}-{layers[-1]} failed "
                                                    f"({error}) after {r.progress()}")
                return
            for layer in layers:
                r.layers.add(layer)
                if not self._call(self._on_layer, r.room, layer, r.dst_slots, None):
                    self._drop_locked(r, "aborted", f"room {r.room}: the decode worker's on_layer callback raised")
                    return
            self._complete_if_ready_locked(r)

    def _teardown(self, conn: Optional[_PairedPeer], reason: str) -> None:
        """Fail the pair's rooms with `reason`, close its control connection and tear down its group."""
        if conn is None:
            return
        with self._lock:
            for r in [r for r in self._rooms.values() if r.conn is conn]:
                self._drop_locked(r, "peer_failed", f"room {r.room}: {reason} ({r.progress()})")
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)  # the connection thread ends and calls _disconnected
        except OSError:
            pass
        if conn.pair is not None:
            conn.pair.close(reason)


def _check_kv_buffer(kv: torch.Tensor | None, layout: KVLayout, transport: str, device_type: str) -> None:
    if kv is None:
        raise ValueError(f"the {transport} KV receiver writes into the decode pool: pass kv_buffer")
    if kv.dim() != 3 or kv.shape[0] < layout.num_kv_layers or kv.shape[2] != layout.kv_dim:
        raise ValueError(f"kv_buffer of shape {tuple(kv.shape)} cannot hold {layout.num_kv_layers} layers of "
                         f"{layout.kv_dim} values per token")
    if kv.dtype != layout.torch_dtype or not kv.is_contiguous():
        raise ValueError(f"kv_buffer must be a contiguous {layout.dtype} tensor, got {kv.dtype}")
    if kv.device.type != device_type:
        raise ValueError(f"the {transport} KV receiver moves {device_type} tensors; kv_buffer is on {kv.device}")
