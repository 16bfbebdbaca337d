"""Decode side of "cuda_ipc" and "auto": the data plane whose HELLO_OK hands a same-node prefill worker an IPC handle
to the decode pool; that sender then writes the rows into the reserved pages itself.

Per connection the handshake picks a plane (`choose_transport`): tcp (frames carry the rows, `tcp.py`) or
cuda_ipc. A cuda_ipc room goes:

    BEGIN {room, num_layers, pages} ->        checked against the reservation (pages, layers): nothing of the
                                               peer's is written anywhere before this answer
    <- GRANT {room, num_tokens}                from now on the sender may write into those pages
    LAYER {room, layer | layers, num_tokens} -> the device copy of layer k (or of the run of layers: the
                                               prefill engine sends a prompt's layers in one) is queued behind
                                               its forward; as many as it takes to cover every layer
    AUX {..., layers} ->                       sent once the sender saw all its copies complete: on_layer for
                                               each layer, then on_done; `layers` (optional) announces the
                                               layers of the room's last send, which then has no LAYER frame
                                               (HELLO_OK's `aux_layers` tells the sender it may)
    ABORT {room} ->                            the sender failed or dropped the room *and* saw its copies complete

A granted room that fails here (cancel, timeout, a bad frame) is *draining*: the sender is told (ROOM_FAILED),
stops writing, and answers ABORT once its copies have completed; only then are its pages released (on_failed, or
False from cancel()). A sender that does not answer within `drain_timeout_s`, or whose connection ends, ends the
pairing: its connection is closed, and the prefill worker drops its mapping after its stream has drained.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from .base import TransferState
from .control_receiver import KVReceiverChannel, Peer, Room, _is_int
from .cuda_ipc_pairing import IPC, TCP, Facts, IpcBackend, choose_transport
from .plane import ReceivePlane
from .tcp import TcpReceivePlane
from .wire import BEGIN, GRANT, LAYER, ProtocolError

logger = logging.getLogger(__name__)


class IpcReceivePlane(ReceivePlane):
    """`ipc`: the GPU facts and calls (`IpcBackend`; the CPU tests pass fakes). The receiver's `kv_buffer` is
    required."""

    name, frames, released_by_abort = IPC, (BEGIN, LAYER), True

    def __init__(self, channel: KVReceiverChannel, ipc: Optional[IpcBackend] = None):
        super().__init__(channel)
        kv = channel.kv
        if kv is None:
            raise ValueError(f"the {channel.transport} KV receiver writes into the decode pool: pass kv_buffer")
        self.tcp = TcpReceivePlane(channel)  # the plane of the pairings that go over tcp
        self._ipc = ipc or IpcBackend()
        self._facts = self._ipc.local_facts(kv.device)
        self._export_problem = self._ipc.export_problem(kv)
        self._export: Optional[dict[str, Any]] = None
        if self._export_problem is None:
            # NOTE: once, here, before the decode engine runs anything on the pool: torch's export re-wraps the
            # storage's data pointer (same address) in its IPC reference counting; every pairing gets these fields.
            try:
                self._export = self._ipc.export(kv)
            except (RuntimeError, ValueError, TypeError) as e:
                self._export_problem = f"exporting the decode pool over CUDA IPC failed: {e}"
        if channel.transport == IPC and self._export_problem:
            raise ValueError(f"--kv-transport cuda_ipc: {self._export_problem} (or use --kv-transport auto/tcp)")

    def pair(self, peer: Peer, hello: dict[str, Any]) -> str | tuple[ReceivePlane, dict[str, Any]]:
        try:
            facts = Facts.from_dict(hello["ipc_facts"]) if "ipc_facts" in hello else None
        except ValueError as e:
            return f"bad HELLO: {e}"
        mode, why = choose_transport(hello.get("transport", TCP), self.channel.transport, facts, self._facts,
                                     self._export_problem)
        if mode is None:
            return why
        logger.info("KV receiver %s paired with prefill %s over %s (%s)", self.channel.endpoint, peer.addr, mode, why)
        if mode == IPC:
            return self, {"transport": mode, "reason": why, "ipc": self._export, "aux_layers": True}
        return self.tcp, {"transport": mode, "reason": why}

    def drains(self, room: Room, notify: bool) -> bool:
        # NOTE: granted, the sender may still have copies queued into its pages: released on its ABORT (or when the
        # pairing ends). Its AUX, or an ABORT it sent, came after its last copy: nothing writes any more.
        return notify and room.granted and room.aux is None

    def aux_layers(self, room: Room, header: dict[str, Any]) -> Optional[Sequence[int]]:
        if not room.granted:
            raise ProtocolError(f"AUX frame for room {room.room} before its BEGIN was granted")
        if "layers" in header and not self._announce_locked(room, header["layers"], room.num_tokens):
            return None
        # The sender saw every copy complete before it sent AUX: the layers have landed.
        return room.announced if len(room.layers) == room.num_layers else ()

    def on_frame(self, peer: Peer, kind: str, room: int, header: dict[str, Any], payload: torch.Tensor) -> None:
        if kind == LAYER and payload.numel():
            raise ProtocolError("a cuda_ipc LAYER frame carries no rows")
        ch = self.channel
        with ch.lock:
            r = ch.live_room_locked(peer, kind, room)
            if r is None:
                return
            if kind == BEGIN:
                return self._begin_locked(peer, r, header)
            if not r.granted:
                raise ProtocolError(f"{kind} frame for room {room} before its BEGIN was granted")
            # One layer ("layer") or several copied at once ("layers": a prompt's whole run, see send_layers).
            self._announce_locked(r, header["layers"] if "layers" in header else [header.get("layer")],
                                  header.get("num_tokens"))

    def _announce_locked(self, r: Room, layers: Any, n: Any) -> bool:
        """Take the sender's word that `layers` (of `n` tokens) were copied into the room's pages; False when the
        announcement is bad and the room failed instead."""
        if (not isinstance(layers, list) or not layers
                or not all(_is_int(layer) and 0 <= layer < r.num_layers and layer not in r.layers for layer in layers)
                or len(set(layers)) != len(layers) or n != r.num_tokens):
            # Copies stayed inside the granted pages; the sender just disagrees about the room: fail it only.
            self.channel.drop_locked(r, "protocol", f"room {r.room}: bad LAYER announcement (layers "
                                                    f"{str(layers)[:80]} of {r.num_layers}, {n!r} tokens, "
                                                    f"{r.num_tokens} expected)")
            return False
        r.layers.update(layers)
        r.announced.extend(layers)
        return True

    def _begin_locked(self, peer: Peer, r: Room, header: dict[str, Any]) -> None:
        if r.granted:
            raise ProtocolError(f"BEGIN for room {r.room} twice")
        pages, num_layers = header.get("pages"), header.get("num_layers")
        need = -(-r.num_tokens // self.channel.layout.page_size)
        r.conn = peer
        if not (isinstance(pages, list) and all(_is_int(p) for p in pages)) or pages[:need] != r.dst_pages[:need] \
                or len(pages) < need or num_layers != r.num_layers:
            self.channel.drop_locked(r, "protocol", f"room {r.room}: prefill would write {num_layers!r} layers into "
                                                    f"pages {str(pages)[:80]}, this decode worker reserved "
                                                    f"{r.num_layers} layers in {r.dst_pages[:need]}")
            return
        r.granted = True
        r.status.advance(TransferState.TRANSFERRING)
        self.channel.reply(peer, {"kind": GRANT, "room": r.room, "num_tokens": r.num_tokens})
