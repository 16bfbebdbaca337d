"""Decode side of "nixl": the data plane whose HELLO_OK hands a prefill worker this worker's NIXL agent metadata and
its registered memory (the KV pool, and a staging area); that sender then WRITEs each room's rows itself (see
`nixl.py` for the room's frames).

At BEGIN the room's pages are checked against its reservation. Pages in few runs are written in place (a descriptor
per layer and run); pages scattered into more than `MAX_DIRECT_RUNS` runs would cost a descriptor per page, so the
room gets a block of the staging area `(num_layers, tokens, kv_dim)` instead (when one is free: otherwise in place
all the same) and each LAYER announcement scatters its layers from there into the pages (`pages.scatter_pages`).
An AUX frame may announce the layers of the room's last send itself (HELLO_OK's `aux_layers` tells the sender it
may): a whole prompt's rows then land with the AUX, in one scatter when staged.

A granted room that fails here (cancel, timeout, a bad frame) while WRITEs may still land in its memory is
*draining*: the sender is told, and answers ABORT once its WRITEs resolved; only then are its pages and its staging
block released. A connection that ends releases its draining rooms (a sender process that died took its WRITEs with
it; one that is alive stops writing when its connection breaks).
"""

from __future__ import annotations

import base64
import logging
import uuid
from typing import Any, Optional, Sequence

import torch

from .base import TransferState
from .control_receiver import KVReceiverChannel, Peer, Room, _is_int
from .nixl_agent import Arena, Block, NixlAgent
from .pages import plan_pages, scatter_pages
from .plane import ReceivePlane
from .wire import BEGIN, GRANT, LAYER, ProtocolError

logger = logging.getLogger(__name__)

NIXL = "nixl"
# Page runs per layer up to which a room is written in place: NIXL's cost is per descriptor, and beyond a few runs
# one WRITE into staging plus a device scatter costs less than a descriptor per run.
MAX_DIRECT_RUNS = 8
DEFAULT_STAGING_SHARE = 8  # the staging area's default size: this fraction of the pool's bytes...
DEFAULT_STAGING_MAX_BYTES = 2 << 30  # ...at most
PROBE_BYTES = 256


class NixlReceivePlane(ReceivePlane):
    """The receiver's `kv_buffer` (required): the decode pool `(num_layers, num_slots, kv_dim)`, contiguous, on the
    CPU or a GPU. `backend`: NIXL's backend (UCX). `staging_bytes`: the staging area for rooms with scattered pages
    (default: an eighth of the pool, at most 2 GiB; 0: none, every room written in place)."""

    name, frames, released_by_abort = NIXL, (BEGIN, LAYER), True

    def __init__(self, channel: KVReceiverChannel, backend: str = "UCX", staging_bytes: Optional[int] = None):
        super().__init__(channel)
        kv, layout = channel.kv, channel.layout
        if kv is None:
            raise ValueError("the nixl KV receiver writes into the decode pool: pass kv_buffer")
        if kv.dim() != 3 or kv.shape[0] < layout.num_kv_layers or kv.shape[2] != layout.kv_dim \
                or kv.dtype != layout.torch_dtype or not kv.is_contiguous():
            raise ValueError(f"kv_buffer {tuple(kv.shape)} {kv.dtype} is not a contiguous pool of "
                             f"{layout.num_kv_layers} layers of {layout.kv_dim} {layout.dtype} values")
        if staging_bytes is None:
            staging_bytes = min(kv.numel() * kv.element_size() // DEFAULT_STAGING_SHARE, DEFAULT_STAGING_MAX_BYTES)
        if staging_bytes < 0:
            raise ValueError(f"staging_bytes={staging_bytes} must be 0 or more")
        self.agent = NixlAgent(f"pdserve-decode-{uuid.uuid4().hex[:12]}", backend, busy=self._writing)
        try:
            pool = self.agent.register(kv)
            self.staging = Arena(self.agent, staging_bytes, kv.device) if staging_bytes else None
            self._probe = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=kv.device)  # each pairing's first WRITE
            probe = self.agent.register(self._probe)
            metadata = self.agent.metadata()  # NOTE: after every registration: it carries them
        except BaseException:
            self.agent.close()
            raise
        staging = None if self.staging is None else self.staging.registered
        self._hello = {"agent": base64.b64encode(metadata).decode(),
                       "pool": {"addr": pool.addr, "nbytes": pool.nbytes, "device": pool.device,
                                "mem_type": pool.mem_type, "shape": list(kv.shape), "dtype": layout.dtype},
                       "staging": None if staging is None else {"addr": staging.addr, "nbytes": staging.nbytes,
                                                                "device": staging.device, "mem_type": staging.mem_type},
                       "probe": {"addr": probe.addr, "nbytes": probe.nbytes, "device": probe.device,
                                 "mem_type": probe.mem_type}}
        self._blocks: dict[Room, Block] = {}  # staged rooms' blocks, until nothing writes or reads them (lock held)
        self._stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None  # scatters beside the decode steps

    def _writing(self) -> bool:
        """Whether a sender may be writing here (the agent's progress thread then runs at its busy pace)."""
        ch = self.channel
        try:
            return bool(ch.draining) or any(r.granted for r in tuple(ch.rooms.values()))
        except RuntimeError:  # the rooms changed while read (without the lock): ask again at the next round
            return True

    def pair(self, peer: Peer, hello: dict[str, Any]) -> str | tuple[ReceivePlane, dict[str, Any]]:
        problem = self.transport_problem(hello)
        if problem:
            return problem
        logger.info("KV receiver %s paired with prefill %s over nixl", self.channel.endpoint, peer.addr)
        return self, {"transport": NIXL, "nixl": self._hello, "aux_layers": True}

    # ---- rooms (the channel's lock held) ----

    def drains(self, room: Room, notify: bool) -> bool:
        # NOTE: granted, the sender may have WRITEs in flight into its memory until it answers ABORT. Its AUX, or
        # the announcement of its last layer, came after its last WRITE resolved: nothing writes any more.
        return notify and room.granted and room.aux is None and len(room.layers) < room.num_layers

    def aux_layers(self, room: Room, header: dict[str, Any]) -> Optional[Sequence[int]]:
        if not room.granted:
            raise ProtocolError(f"AUX frame for room {room.room} before its BEGIN was granted")
        if "layers" not in header:
            return ()  # every layer landed at its announcement
        # The AUX came after every WRITE of the room resolved: the layers it names are in (staged: scattered here).
        return header["layers"] if self._announce_locked(room, header["layers"], room.num_tokens) else None

    def on_frame(self, peer: Peer, kind: str, room: int, header: dict[str, Any], payload: torch.Tensor) -> None:
        if payload.numel():
            raise ProtocolError(f"a nixl {kind} frame carries no rows")
        ch = self.channel
        with ch.lock:
            if self._blocks:
                self._sweep_locked()
            r = ch.live_room_locked(peer, kind, room)
            if r is None:
                return
            if kind == BEGIN:
                return self._begin_locked(peer, r, header)
            if not r.granted:
                raise ProtocolError(f"{kind} frame for room {room} before its BEGIN was granted")
            layers = header["layers"] if "layers" in header else [header.get("layer")]
            if self._announce_locked(r, layers, header.get("num_tokens")):
                ch.land_locked(r, layers)

    def _announce_locked(self, r: Room, layers: Any, n: Any) -> bool:
        """The sender says the WRITEs of `layers` (of `n` tokens) are DONE: a staged room's are scattered into its
        pages now. False when the announcement is bad and the room failed instead."""
        if (not isinstance(layers, list) or not layers or not all(_is_int(x) for x in layers)
                or layers != list(range(layers[0], layers[0] + len(layers)))
                or not (0 <= layers[0] and layers[-1] < r.num_layers) or r.layers.intersection(layers)
                or n != r.num_tokens):
            # The WRITEs stayed inside the granted memory; the sender just disagrees about the room: fail it only.
            self.channel.drop_locked(r, "protocol", f"room {r.room}: bad LAYER announcement (layers "
                                                    f"{str(layers)[:80]} of {r.num_layers}, {n!r} tokens, "
                                                    f"{r.num_tokens} expected)")
            return False
        block = self._blocks.get(r)
        if block is not None:
            self._scatter(r, layers, block)
            if len(r.layers) + len(layers) == r.num_layers:
                del self._blocks[r]  # every layer scattered: nothing reads or writes it any more
        return True

    def _begin_locked(self, peer: Peer, r: Room, header: dict[str, Any]) -> None:
        ch = self.channel
        if r.granted:
            raise ProtocolError(f"BEGIN for room {r.room} twice")
        pages, num_layers = header.get("pages"), header.get("num_layers")
        need = -(-r.num_tokens // ch.layout.page_size)
        r.conn = peer
        if not (isinstance(pages, list) and all(_is_int(p) for p in pages)) or pages[:need] != r.dst_pages[:need] \
                or len(pages) < need or num_layers != r.num_layers:
            ch.drop_locked(r, "protocol", f"room {r.room}: prefill would write {num_layers!r} layers into pages "
                                          f"{str(pages)[:80]}, this decode worker reserved {r.num_layers} layers in "
                                          f"{r.dst_pages[:need]}")
            return
        block = None
        if self.staging is not None and len(plan_pages(r.dst_pages, r.num_tokens, ch.layout.page_size).runs) \
                > MAX_DIRECT_RUNS:
            row_bytes = ch.layout.kv_dim * ch.kv.element_size()
            block = self.staging.take(r.num_layers * r.num_tokens * row_bytes)
            if block is not None:
                self._blocks[r] = block
                r.plan = plan_pages(r.dst_pages, r.num_tokens, ch.layout.page_size, ch.kv.device)
        r.granted = True
        r.status.advance(TransferState.TRANSFERRING)
        ch.reply(peer, {"kind": GRANT, "room": r.room, "num_tokens": r.num_tokens,
                        "staging": None if block is None else block.offset})

    def _scatter(self, r: Room, layers: list[int], block: Block) -> None:
        """The announced layers from the room's staging block into its pages; done when this returns (so the decode
        engine reads them once it hears of the room, and the block is free once the room's last layer is in)."""
        kv = self.channel.kv
        staged = block.view((r.num_layers, r.num_tokens, kv.shape[2]), kv.dtype)  # (room layers, tokens, kv_dim)
        target, rows = kv[layers[0]:layers[-1] + 1], staged[layers[0]:layers[-1] + 1]
        if self._stream is None:
            scatter_pages(target, rows, r.plan)
            return
        self._stream.wait_stream(torch.cuda.current_stream(kv.device))  # the plan's page index was made there
        with torch.cuda.stream(self._stream):
            scatter_pages(target, rows, r.plan)
        self._stream.synchronize()

    def _sweep_locked(self) -> None:
        """Staging blocks of rooms that ended (done, failed and released) go back to the arena (at the next frame:
        the channel releases a draining room without telling its plane)."""
        ch = self.channel
        for r in [r for r in self._blocks if ch.rooms.get(r.room) is not r and ch.draining.get(r.room) is not r]:
            del self._blocks[r]

    # ---- pairings ----

    def disconnected(self, peer: Peer) -> None:
        # Its rooms already failed: the draining ones are released now (see the module's docstring).
        self._release(lambda r: r.conn is peer)

    def close(self) -> None:
        self._release(lambda r: True)  # the connections are down: rooms still waiting for their sender's release
        with self.channel.lock:
            self._blocks.clear()
        self.agent.close()

    def _release(self, which) -> None:
        ch = self.channel
        with ch.lock:
            for r in [r for r in ch.draining.values() if which(r)]:
                ch.release_locked(r)
            self._sweep_locked()


__all__ = ["MAX_DIRECT_RUNS", "NixlReceivePlane"]
