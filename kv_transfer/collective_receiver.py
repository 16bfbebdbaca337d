"""Decode side of the collective KV transports: a data plane whose pairings each build a process group with their
sender, and whose receives land straight in the decode pool.

The receiver hosts a `TCPStore`; HELLO_OK names it and a fresh group id, and both sides join that group (the
connection thread here, the pairing's `open` on the sender). Each LAYER announcement names a layer or a run of
layers and the token count: one op carries their rows as one contiguous block. The connection thread, which reads
announcements in order, posts one receive into a staging block on the pool's device under the receiver lock, and
behind it, on the pair's stream, the scatter of the block into the room's reserved pages (`pages.py`). A room the
receiver no longer wants (cancelled, timed out, aborted, unknown) still gets its announced ops received, into
scratch: the op streams of both sides never diverge, so one room's failure costs the pair nothing.

A room that fails while receives are landing in its pages is *draining*: it is gone for the sender at once (it is
told), but its pages are not released (on_failed, or False from cancel()) until those receives resolved. A room
still draining `drain_timeout_s` later means the pair's op stream is stuck: the pair is torn down (its control
connection closed, its group aborted), which resolves every op; the sender reconnects with a new group.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from functools import partial
from typing import Any, Optional

import torch

from .base import KVLayout, TransferState
from .collective_pair import BACKENDS, DECODE_RANK, ProcessGroupPair
from .control_receiver import KVReceiverChannel, Peer, Room, _is_int
from .pages import plan_pages, scatter_pages
from .plane import ReceivePlane
from .wire import LAYER, ProtocolError

logger = logging.getLogger(__name__)


class CollectiveReceivePlane(ReceivePlane):
    """The receiver's `transport` names a backend of `BACKENDS`; its `kv_buffer` (required): the decode pool
    `(num_layers, num_slots, kv_dim)`, contiguous, of the layout's dtype, on the backend's device type."""

    def __init__(self, channel: KVReceiverChannel):
        super().__init__(channel)
        self.name = channel.transport
        self.backend = BACKENDS[channel.transport]
        _check_kv_buffer(channel.kv, channel.layout, self.name, self.backend.device_type)
        import torch.distributed as dist

        self._store = dist.TCPStore(channel.host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=channel.handshake_timeout_s))

    def close(self) -> None:
        self._store = None  # stops the store's server

    # ---- pairing ----

    def pair(self, peer: Peer, hello: dict[str, Any]) -> str | tuple[ReceivePlane, dict[str, Any]]:
        problem = self.transport_problem(hello)
        if problem:
            return problem
        host = peer.sock.getsockname()[0]  # the address this sender reached us on
        host = f"[{host}]" if ":" in host else host
        # The group id is unguessable: the store is open, the group name is only told after HELLO.
        return self, {"store": f"{host}:{self._store.port}", "group": uuid.uuid4().hex}

    def paired(self, peer: Peer, hello_ok: dict[str, Any]) -> bool:
        ch, local_host = self.channel, peer.sock.getsockname()[0]
        try:
            peer.link = ProcessGroupPair.connect(
                self.backend, (local_host, self._store.port), hello_ok["group"], DECODE_RANK, local_host=local_host,
                device=ch.kv.device, connect_timeout_s=ch.handshake_timeout_s, op_timeout_s=ch.timeout_s,
                name=f"decode<-{peer.addr}")
        except (RuntimeError, ValueError) as e:
            logger.warning("KV receiver %s: no %s process group with prefill %s: %s", ch.endpoint, self.name,
                           peer.addr, e)
            return False
        peer.link.on_broken = partial(self.teardown, peer)
        return True

    def disconnected(self, peer: Peer) -> None:
        if peer.link is not None:
            peer.link.close(f"the control connection from prefill {peer.addr} ended")

    def teardown(self, peer: Peer, reason: str) -> None:
        """Fail the pair's rooms with `reason`, close its control connection and tear down its group."""
        ch = self.channel
        with ch.lock:
            for r in [r for r in ch.rooms.values() if r.conn is peer]:
                ch.drop_locked(r, "peer_failed", f"room {r.room}: {reason} ({r.progress()})")
        peer.shutdown()  # the connection thread ends and calls disconnected
        if peer.link is not None:
            peer.link.close(reason)

    # ---- rooms ----

    def expected(self, room: Room) -> None:
        room.ready = self.backend.ready_event(self.channel.kv.device)

    def drains(self, room: Room, notify: bool) -> bool:
        return room.inflight > 0  # NOTE: receives are landing in its pages: freed only once they resolved

    def on_frame(self, peer: Peer, kind: str, room: int, header: dict[str, Any], payload: torch.Tensor) -> None:
        ch = self.channel
        n, layers = header.get("num_tokens"), header.get("layers", [header.get("layer")])
        if not (_is_int(n) and 0 < n <= ch.max_room_tokens and isinstance(layers, list)
                and 0 < len(layers) <= ch.layout.num_kv_layers and all(_is_int(x) for x in layers)
                and payload.numel() == 0):
            # Without a trustworthy block size there is no knowing what the sender's op carries (and nothing larger
            # than a room of every layer is allocated for it).
            raise ProtocolError(f"LAYER announcement without a valid room, layers and token count: "
                                f"{str(header)[:200]}")
        block = torch.empty(len(layers), n, ch.layout.kv_dim, dtype=ch.kv.dtype, device=ch.kv.device)
        with ch.lock:
            r = ch.live_room_locked(peer, kind, room)
            if r is None:  # received and dropped, so the next announcement's op lines up
                self._post(peer, [block])
                return
            r.conn = peer
            try:
                self._check_announcement(r, layers, n)
            except ValueError as e:
                ch.drop_locked(r, "protocol", f"room {room}: bad LAYER announcement: {e}")
                raise ProtocolError(f"bad LAYER announcement for room {room}: {e}") from None
            self._post(peer, [block], r.ready, partial(self._landed, r, layers),
                       then=partial(self._scatter, r, layers, block))
            r.status.advance(TransferState.TRANSFERRING)
            r.posted.update(layers)
            r.inflight += 1

    def _scatter(self, r: Room, layers: list[int], block: torch.Tensor) -> None:
        """On the pair's stream, behind the block's receive: the block into the room's pages of its layers."""
        kv = self.channel.kv
        if r.plan is None:
            r.plan = plan_pages(r.dst_pages, r.num_tokens, self.channel.layout.page_size, kv.device)
        scatter_pages(kv[layers[0]:layers[-1] + 1], block, r.plan)

    @staticmethod
    def _post(peer: Peer, buffers: list[torch.Tensor], after: Any = None, on_complete=None, then=None) -> None:
        try:
            peer.link.post(buffers, send=False, after=after, on_complete=on_complete, then=then)
        except RuntimeError as e:
            raise ConnectionError(f"posting receives failed: {e}") from None  # ends the connection: peer_failed

    @staticmethod
    def _check_announcement(r: Room, layers: list[int], n: int) -> None:
        if layers != list(range(layers[0], layers[0] + len(layers))):
            raise ValueError(f"layers {layers[:8]} are not a run of consecutive layers")
        if not (0 <= layers[0] and layers[-1] < r.num_layers):
            raise ValueError(f"layers {layers[0]}-{layers[-1]} are outside the room's {r.num_layers} layers")
        if r.posted.intersection(layers):
            raise ValueError(f"layer {min(r.posted.intersection(layers))} arrived twice")
        if n != r.num_tokens:
            raise ValueError(f"prefill sent {n!r} tokens, decode expected {r.num_tokens}")

    def _landed(self, r: Room, layers: list[int], error: Optional[str]) -> None:
        """The pair's reaper thread: the block's receive (and its scatter) resolved."""
        ch = self.channel
        with ch.answering(), ch.lock:
            r.inflight -= 1
            if ch.draining.get(r.room) is r:
                if r.inflight == 0:
                    ch.release_locked(r)
                return
            if ch.rooms.get(r.room) is not r:
                return
            if error is not None:
                ch.drop_locked(r, "peer_failed", f"room {r.room}: receiving layers {layers[0]}-{layers[-1]} failed "
                                                 f"({error}) after {r.progress()}")
                return
            ch.land_locked(r, layers)


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
