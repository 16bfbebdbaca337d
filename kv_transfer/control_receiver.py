"""Decode side of the control channel every KV transport shares: a listening socket, the handshake, rooms and their
deadlines, aborts, the AUX record and the answers to the senders; the pairing's data plane (`plane.py`) lands the
rows in the reserved pages.

Threads (all daemons): one accept thread, one thread per sender connection (reads frames, delivers on_layer /
on_done and the failures it detects, writes its answers: `answering`), one timer thread (room deadlines, draining
rooms), one notifier thread (writes the answers other threads make, so no caller ever blocks on a slow peer).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import queue
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch

from pdserve.common.trace import mark

from .base import (
    KVLayout, KVReceiver, KVTransferError, OnDone, OnFailed, OnLayer, TransferState, TransferStatus,
    dtype_from_name, room_key, token_slots,
)
from .plane import ReceivePlane
from .wire import (
    ABORT, AUX, HELLO, HELLO_ERROR, HELLO_OK, ROOM_DONE, ROOM_FAILED, ProtocolError, configure_socket,
    payload_crc32, recv_frame, send_frame,
)

logger = logging.getLogger(__name__)

_MAX_REMEMBERED = 4096  # finished rooms whose late frames are still answered with the right error kind
_MAX_AUX_PAYLOAD = 64 << 20  # hidden state (hidden_size floats) + RNG state: far below this for any model
_DEFAULT_MAX_ROOM_TOKENS = 1 << 20  # when the owner does not say how many tokens its pool holds
HELLO_MAX_JSON_BYTES = 64 << 10  # a HELLO is a layout and a few facts: far below this
# Connections accepted and not yet through their handshake, each a thread: from one host, and in all.
MAX_HANDSHAKES_PER_HOST, MAX_HANDSHAKES = 16, 256


class Peer:
    """One sender connection, as seen by the receiver."""

    def __init__(self, sock: socket.socket, addr: str):
        self.sock, self.addr = sock, addr
        self.send_lock = threading.Lock()
        self.plane: Optional[ReceivePlane] = None  # the data plane its handshake chose
        self.link: Any = None  # what that plane set up with this sender (collective: its process group pair)

    def send(self, header: dict[str, Any]) -> None:
        try:
            with self.send_lock:
                send_frame(self.sock, header)
        except OSError:
            pass  # the connection thread notices the broken socket and fails the rooms

    def shutdown(self) -> None:
        """End the connection: its thread wakes, fails its rooms and closes the socket."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Room:
    """One expected room. The fields after `conn` belong to the data planes."""

    def __init__(self, room: int, num_tokens: int, dst_pages: list[int], dst_slots: torch.Tensor, num_layers: int,
                 deadline: float):
        self.room, self.num_tokens, self.dst_pages, self.dst_slots = room, num_tokens, dst_pages, dst_slots
        self.num_layers, self.deadline = num_layers, deadline
        self.status = TransferStatus(TransferState.WAITING_FOR_DEST)
        self.layers: set[int] = set()  # announced or received
        self.aux: dict[str, Any] | None = None
        self.conn: Peer | None = None  # the connection its frames came in on
        self.owed: Optional[tuple[str, str]] = None  # (kind, message) of the on_failed delivered once released
        self.drain_deadline = 0.0
        self.pool_slots: torch.Tensor | None = None  # tcp: dst_slots on the pool's device, made at the first layer
        self.granted = False  # cuda_ipc: the sender may be writing into its pages
        self.announced: list[int] = []  # cuda_ipc: layers in the order the sender queued them
        self.ready: Any = None  # collective: event after the compute queued before expect(), the pages' last readers
        self.plan: Any = None  # collective: the PagePlan, made on the pair's stream at the first scatter
        self.posted: set[int] = set()  # collective: layers whose receives were posted
        self.inflight = 0  # collective: ops posted and not yet resolved

    def progress(self) -> str:
        return f"{len(self.layers)}/{self.num_layers} layers, aux {'received' if self.aux is not None else 'missing'}"


class KVReceiverChannel(KVReceiver):
    """See `KVReceiver`: the decode side of every transport, its rows landed by `plane_cls` (set by each transport's
    receiver class; other options go to it). `endpoint` advertises `advertise_host` (default: `host`) and the port
    actually bound. token: senders must present it in HELLO (None: no check). max_room_tokens: the most tokens a
    room can have (the KV pool's capacity); bounds the payload a peer may announce. kv_buffer: the decode pool
    `(num_layers, num_slots, kv_dim)`; given, the rows land in the room's pages and on_layer gets values=None (so
    the decode engine's thread never copies KV); without it (tcp only) the rows go to on_layer. drain_timeout_s:
    how long a failed room whose pages may still be written waits for them before its pairing is torn down."""

    transport: str  # its --kv-transport: a sender the plane cannot pair with is refused as "incompatible"
    plane_cls: type[ReceivePlane]

    def __init__(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, *, on_layer: OnLayer,
                 on_done: OnDone, on_failed: OnFailed, timeout_s: float = 300.0, handshake_timeout_s: float = 10.0,
                 advertise_host: str | None = None, token: str | None = None, max_room_tokens: int | None = None,
                 kv_buffer: torch.Tensor | None = None, drain_timeout_s: float = 5.0, **plane_options: Any):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        self.layout, self.host, self.timeout_s, self.handshake_timeout_s = layout, host, timeout_s, handshake_timeout_s
        self.drain_timeout_s, self.kv = drain_timeout_s, kv_buffer
        self._token = token
        self.max_room_tokens = max_room_tokens or _DEFAULT_MAX_ROOM_TOKENS
        row_bytes = layout.kv_dim * layout.torch_dtype.itemsize
        self._max_payload = max(_MAX_AUX_PAYLOAD, self.max_room_tokens * row_bytes)
        self._on_layer, self._on_done, self._on_failed = on_layer, on_done, on_failed
        # NOTE: re-entrant because callbacks run under it and may call cancel()/expect().
        self.lock = threading.RLock()
        self.rooms: dict[int, Room] = {}
        self.draining: dict[int, Room] = {}  # failed, pages not yet released (see ReceivePlane.drains)
        self._dropped: OrderedDict[int, tuple[str, str]] = OrderedDict()  # room -> (error kind, message)
        self._conns: dict[Peer, threading.Thread] = {}
        self._handshaking: dict[str, int] = {}  # host -> its connections not yet through the handshake
        self.refused_connections = 0  # closed at accept: their host had too many handshakes pending
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._local = threading.local()  # .pending: the replies of a thread inside answering()
        self._stop = threading.Event()
        self.plane = self.plane_cls(self, **plane_options)  # NOTE: before accepting: the threads call it
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
        with self.lock:
            return len(self.rooms)

    def expect(self, room: int, num_tokens: int, dst_pages: Sequence[int], num_layers: int) -> None:
        if not 0 <= room < 2**64:
            raise ValueError(f"room={room} must be a uint64")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens={num_tokens} must be positive")
        if not 0 < num_layers <= self.layout.num_kv_layers:
            raise ValueError(f"num_layers={num_layers} must be in [1, {self.layout.num_kv_layers}]")
        slots = token_slots(dst_pages, num_tokens, self.layout.page_size)  # (num_tokens,)
        with self.lock:
            if self._stop.is_set():
                raise RuntimeError(f"{type(self).__name__} is closed")
            if room in self.rooms:
                raise ValueError(f"room {room} is already expected")
            if room in self.draining:
                raise ValueError(f"room {room} is still draining its previous transfer")
            if self.kv is not None and int(slots.max()) >= self.kv.shape[1]:
                raise ValueError(f"dst_pages reach slot {int(slots.max())}; kv_buffer has {self.kv.shape[1]} slots")
            r = Room(room, num_tokens, [int(p) for p in dst_pages], slots, num_layers,
                     time.monotonic() + self.timeout_s)
            self.plane.expected(r)
            self._dropped.pop(room, None)
            self.rooms[room] = r

    def cancel(self, room: int) -> bool:
        with self.lock:
            r = self.rooms.get(room)
            if r is None:
                return False
            held = self._drains(r, notify=True)  # its pages may still be written: the caller frees them on on_failed
            self.drop_locked(r, "aborted", f"room {room} was cancelled by the decode worker", callback=held)
            return not held

    def close(self) -> None:
        with self.lock:
            if self._stop.is_set():
                return
            self._stop.set()
            for r in list(self.rooms.values()):
                self.drop_locked(r, "aborted", f"room {r.room}: the KV receiver closed ({r.progress()})", notify=False)
            conns = dict(self._conns)
        self._outbox.put(None)
        for t in self._threads:
            t.join(timeout=2.0)
        self._listener.close()
        for conn, t in conns.items():
            conn.shutdown()  # wakes its thread, which closes the socket
            t.join(timeout=2.0)
        with self.lock:
            self._release_ended_locked(lambda r: True)  # (a connection's thread that did not end in time)
        self.plane.close()

    # ---- rooms, for the data planes too (with `lock` held) ----

    def live_room_locked(self, peer: Peer, kind: str, room: int) -> Room | None:
        """The room a frame from `peer` is for, or None: a frame for a draining room of this connection (an ABORT
        releases it where its plane says so) or for a room not (or no longer) expected (the sender is told why)."""
        drained = self.draining.get(room)
        if drained is not None and drained.conn is peer:
            if kind == ABORT and peer.plane.released_by_abort:
                self.release_locked(drained)  # the sender's writes into its pages completed
            return None  # frames it queued before it learned the room failed
        r = self.rooms.get(room)
        if r is None:
            if kind != ABORT:  # an ABORT for a finished room needs no answer
                err_kind, message = self._dropped.get(room, (
                    "protocol", f"room {room} is not expected by this decode worker (expect() must be called "
                                f"before the room is handed to prefill)"))
                self.reply(peer, {"kind": ROOM_FAILED, "room": room, "error_kind": err_kind, "message": message})
            return None
        if r.conn is not None and r.conn is not peer:
            # Only the connection that started a room may write into it: one peer cannot touch another's rows.
            raise ProtocolError(f"{kind} frame for room {room}, which another connection is sending")
        return r

    def read_locked(self, r: Room, kind: str, header: dict[str, Any], payload: torch.Tensor,
                    parse: Callable[[Room, dict[str, Any], torch.Tensor], Any]) -> Any:
        """`parse(r, header, payload)` of a frame whose checksum holds; None when the room failed instead. A frame
        that does not parse fails its room and ends the connection."""
        crc = header.get("crc32")
        if crc is not None and crc != payload_crc32(memoryview(payload.numpy())):
            # The framing is intact (lengths matched), only the bytes differ: fail the room, keep the link.
            self.drop_locked(r, "protocol", f"room {r.room}: {kind} frame failed its checksum (crc32 {crc!r} "
                                            f"announced); the KV data was corrupted in transit")
            return None
        try:
            return parse(r, header, payload)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            self.drop_locked(r, "protocol", f"room {r.room}: bad {kind} frame: {e}")
            # A peer that sends the wrong shapes cannot be trusted with the rest of its frames.
            raise ProtocolError(f"bad {kind} frame for room {r.room}: {e}") from None

    def land_locked(self, r: Room, layers: Sequence[int], values: torch.Tensor | None = None) -> None:
        """`layers` of the room are in its pages (or in `values`, without kv_buffer): on_layer for each, then
        ROOM_DONE and on_done once every layer and the AUX record are in."""
        for layer in layers:
            r.layers.add(layer)
            if not self._call(self._on_layer, r.room, layer, r.dst_slots, values):
                self.drop_locked(r, "aborted", f"room {r.room}: the decode worker's on_layer callback raised")
                return
        if len(r.layers) != r.num_layers or r.aux is None:
            return
        r.status.advance(TransferState.DONE)
        del self.rooms[r.room]
        self._remember_locked(r.room, "protocol", f"room {r.room} already completed")
        self.reply(r.conn, {"kind": ROOM_DONE, "room": r.room})
        mark("kv.landed", room_key(r.room))
        self._call(self._on_done, r.room, r.aux)

    def drop_locked(self, r: Room, kind: str, message: str, notify: bool = True, callback: bool = True) -> None:
        """Fail room `r` once: forget it, remember why (for late frames), tell its sender, call on_failed; or, when
        its pages may still be written, keep it draining until `release_locked`."""
        if callback and not r.status.finished and self._drains(r, notify):
            r.owed, r.drain_deadline = (kind, message), time.monotonic() + self.drain_timeout_s
            self.draining[r.room] = r
            callback = False
        if not r.status.fail(kind, message):
            return
        del self.rooms[r.room]
        self._remember_locked(r.room, kind, message)
        if notify and r.conn is not None:
            self.reply(r.conn, {"kind": ROOM_FAILED, "room": r.room, "error_kind": kind, "message": message})
        if callback:
            self._call(self._on_failed, r.room, self._room_error(r, kind, message))

    def release_locked(self, r: Room) -> None:
        """Nothing writes into the draining room's pages any more: its on_failed now."""
        if self.draining.pop(r.room, None) is r:
            self._call(self._on_failed, r.room, self._room_error(r, *r.owed))

    def reply(self, peer: Peer, header: dict[str, Any]) -> None:
        """Send `header` to the sender: inside `answering()`, from this thread once it leaves it; otherwise from the
        notifier thread, so that no caller (the decode engine's thread, the timer) waits for a slow peer."""
        pending = getattr(self._local, "pending", None)
        if pending is None:
            self._outbox.put((peer, header))
        else:
            pending.append((peer, header))

    @contextlib.contextmanager
    def answering(self):
        """The replies made inside (GRANT, ROOM_DONE, ROOM_FAILED) go out from this thread, one of the receiver's own
        (a connection's, a process group's), as it leaves, after the lock: a transfer's answers take no trip through
        the notifier thread. Enter it without the lock held."""
        pending = self._local.pending = []
        try:
            yield
        finally:
            self._local.pending = None
            for peer, header in pending:
                peer.send(header)

    def _release_ended_locked(self, which: Callable[[Room], bool]) -> None:
        """The draining rooms of `which` whose connection ended, where the sender's writes went with it."""
        for r in [r for r in self.draining.values() if which(r) and r.conn.plane.released_by_abort]:
            self.release_locked(r)

    def _drains(self, r: Room, notify: bool) -> bool:
        return r.conn is not None and r.conn.plane.drains(r, notify)

    def _room_error(self, r: Room, kind: str, message: str) -> KVTransferError:
        """The error on_failed gets for room `r`; `transport` says what its rows travelled over."""
        error = KVTransferError(kind, message)
        error.transport = r.conn.plane.name if r.conn is not None else self.transport
        return error

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

    def _on_data(self, peer: Peer, kind: str, header: dict[str, Any], payload: torch.Tensor) -> None:
        room = header.get("room")
        if not _is_int(room):
            raise ProtocolError(f"{kind} frame without an integer room: {str(header)[:200]}")
        if kind not in (AUX, ABORT):
            return peer.plane.on_frame(peer, kind, room, header, payload)
        with self.lock:
            r = self.live_room_locked(peer, kind, room)
            if r is None:
                return
            if kind == ABORT:
                r.conn = peer
                self.drop_locked(r, "aborted", f"room {room} was aborted by the prefill worker ({r.progress()})",
                                 notify=False)
                return
            layers = peer.plane.aux_layers(r, header)
            if layers is None:
                return
            r.conn = peer
            aux = self.read_locked(r, kind, header, payload, self._parse_aux)
            if aux is None:
                return
            r.status.advance(TransferState.TRANSFERRING)
            r.aux = aux
            self.land_locked(r, layers)

    @staticmethod
    def _parse_aux(r: Room, header: dict[str, Any], payload: torch.Tensor) -> dict[str, Any]:
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
            conn = Peer(sock, f"{addr[0]}:{addr[1]}")
            t = threading.Thread(target=self._serve, args=(conn,), name=f"kv-recv-{conn.addr}", daemon=True)
            with self.lock:
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

    def _handshake_over(self, conn: Peer) -> None:
        host = conn.addr.rsplit(":", 1)[0]
        with self.lock:
            left = self._handshaking.get(host, 0) - 1
            if left > 0:
                self._handshaking[host] = left
            else:
                self._handshaking.pop(host, None)

    def _serve(self, conn: Peer) -> None:
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
                mark(f"kv.recv_{str(header['kind']).lower()}", room_key(header.get("room")))
                if header["kind"] not in (AUX, ABORT) and header["kind"] not in conn.plane.frames:
                    raise ProtocolError(f"unexpected {header['kind']} frame")
                with self.answering():
                    self._on_data(conn, header["kind"], header, payload)
        except ProtocolError as e:
            kind, why = "protocol", f"the prefill connection from {conn.addr} sent garbage ({e})"
        except OSError as e:
            why += f" ({e})"
        finally:
            if handshaking:
                self._handshake_over(conn)
            with self.lock:
                self._conns.pop(conn, None)
                for r in [r for r in self.rooms.values() if r.conn is conn]:
                    self.drop_locked(r, kind, f"room {r.room}: {why} after {r.progress()}", notify=False)
                self._release_ended_locked(lambda r: r.conn is conn)
            if conn.plane is not None:
                conn.plane.disconnected(conn)
            conn.sock.close()

    def _handshake(self, conn: Peer) -> bool:
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
            choice = f"KV layout mismatch: {problem}" if problem else self.plane.pair(conn, header)
        except (ValueError, KeyError, TypeError) as e:
            choice = f"bad HELLO: {e}"
        if isinstance(choice, str):
            logger.warning("KV receiver %s refused prefill %s: %s", self._endpoint, conn.addr, choice)
            conn.send({"kind": HELLO_ERROR, "message": choice})
            return False
        conn.plane, fields = choice
        conn.send({"kind": HELLO_OK, **fields})
        return conn.plane.paired(conn, fields)

    def _timer_loop(self, tick: float) -> None:
        while not self._stop.wait(tick):
            now = time.monotonic()
            with self.lock:
                for r in [r for r in self.rooms.values() if now >= r.deadline]:
                    self.drop_locked(r, "timeout", f"room {r.room}: the KV transfer did not complete within "
                                                   f"{self.timeout_s:g} s of expect() ({r.progress()})")
                for r in [r for r in self.draining.values() if now >= r.drain_deadline]:
                    r.drain_deadline = float("inf")  # torn down once; the teardown releases the room
                    reason = f"room {r.room} was still being written {self.drain_timeout_s:g} s after it failed"
                    logger.warning("KV receiver %s: %s; closing the pairing with prefill %s", self._endpoint, reason,
                                   r.conn.addr)
                    # Off the timer thread: aborting a communicator may take a while, and the lock is held here.
                    threading.Thread(target=r.conn.plane.teardown, args=(r.conn, reason), name="kv-recv-teardown",
                                     daemon=True).start()

    def _notify_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            conn, header = item
            conn.send(header)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_ok(given: Any, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
