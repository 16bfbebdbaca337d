"""Prefill side of "nixl": the pairing (the decode worker's NIXL agent and registered memory, from its HELLO_OK) and
the data plane that WRITEs each room's rows into that memory, a few WRITEs per `send` (see `nixl.py`).

Rows. `send` gathers the rows of its layers `(layers, tokens, kv_dim)` into blocks of this sender's registered
arena, on a GPU in a few runs of layers (`pages.chunk_count`; one gather each, on the caller's stream, an event after
each), so the caller may reuse its pool at once and each WRITE reads memory NIXL already knows; a run is at most half
the arena. When the arena has no room left a run is gathered into a plain tensor instead, and the writer thread moves
it into the arena if earlier WRITEs free enough of it within `_ARENA_WAIT_S`, else registers it for its one WRITE (as
one larger than the whole arena always is): the room it waits for may be held by a later send, gathered on the
caller's thread and queued behind it, or by another connection's, so waiting on would deadlock. The prefill engine's
thread never waits for the link.

Writer thread, per LAYER item (one `send`) in queue order: wait for the room's GRANT (`grants.py`); post one WRITE per
run as soon as its gather is done, without waiting for the earlier ones (one descriptor per layer and page run into
the decode pool, or one descriptor into the room's staging block when the decode worker granted one: its pages are
scattered); poll them until every one resolved; then one LAYER frame names the send's layers, except for the send
that completes the room where the decode worker takes its layers in the AUX frame (HELLO_OK's `aux_layers`), which
follows it. The page runs of a room written in place are worked out when its GRANT arrives (the reader thread). NIXL reports a WRITE
DONE once its data is in the peer's memory, so a LAYER frame always follows its rows and the AUX or an ABORT (after
every WRITE of the room resolved) tells the decode worker that nothing of the room is still being written. A WRITE in
ERR means the link to the decode worker failed: the connection breaks and its rooms fail (peer_failed).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .base import KVTransferError, TransferState
from .control_sender import RoomHandle
from .grants import Grant, await_grant, fail_granted, on_grant, open_granted
from .nixl_agent import Arena, Block, NixlAgent, Region, Registered, device_id
from .pages import chunk_count, plan_pages
from .plane import SendPairing, SendPlane
from .wire import LAYER, ProtocolError

logger = logging.getLogger(__name__)

NIXL = "nixl"
DEFAULT_SEND_ARENA_BYTES = 256 << 20  # rows of a few rooms' layers in flight; larger ones wait or register apart
_POLL_SPIN_S = 0.001  # a WRITE is polled back to back this long, then with short sleeps (the CPU is shared)
_POLL_SLEEP_S = 0.0002
_ARENA_WAIT_S = 0.002  # a run gathered outside the arena waits this long for room, then is registered by itself
_ABANDONED_WAIT_S = 5.0  # how long an ended connection waits for WRITEs it stopped polling before it lets them go
_PROBE_BYTES = 256  # the pairing's first WRITE


@dataclass(frozen=True)
class RemoteMemory:
    """A registered tensor of the decode worker, as its HELLO_OK describes it."""

    addr: int
    nbytes: int
    device: int
    mem_type: str

    @classmethod
    def parse(cls, fields: Any, what: str) -> "RemoteMemory":
        if not isinstance(fields, dict):
            raise ValueError(f"HELLO_OK describes no {what}")
        values = [fields.get(k) for k in ("addr", "nbytes", "device")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64 for v in values) \
                or fields.get("mem_type") not in ("DRAM", "VRAM"):
            raise ValueError(f"the {what}'s address, size, device or memory type is malformed: {str(fields)[:200]}")
        return cls(*values, fields["mem_type"])


@dataclass(frozen=True)
class DecodeMemory:
    """What a decode worker's HELLO_OK offers: its agent and the memory it registered."""

    metadata: bytes  # its NIXL agent's
    pool: RemoteMemory
    pool_shape: tuple[int, ...]  # (layers, slots, kv_dim)
    staging: Optional[RemoteMemory]  # where rooms with scattered pages are written; None: none
    probe: RemoteMemory  # written once at pairing: proves the data path and makes UCX pick (and print) it


def parse_hello_ok(hello_ok: dict[str, Any], layout) -> DecodeMemory:
    """The decode worker's memory from HELLO_OK, checked against `layout` before anything of it reaches NIXL.
    ValueError says what is wrong."""
    nixl = hello_ok.get("nixl")
    if not isinstance(nixl, dict) or not isinstance(nixl.get("agent"), str):
        raise ValueError("HELLO_OK for nixl without the decode worker's agent metadata")
    try:
        metadata = base64.b64decode(nixl["agent"], validate=True)
    except ValueError:
        raise ValueError("the agent metadata is not base64") from None
    pool = RemoteMemory.parse(nixl.get("pool"), "KV pool")
    shape, dtype = nixl["pool"].get("shape"), nixl["pool"].get("dtype")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(d, int) and d > 0 for d in shape)):
        raise ValueError(f"pool shape {shape!r} is not (layers, slots, kv_dim)")
    if dtype != layout.dtype or shape[2] != layout.kv_dim or shape[0] < layout.num_kv_layers \
            or shape[1] < layout.page_size:
        raise ValueError(f"pool {shape} {dtype} does not hold {layout.num_kv_layers} layers of {layout.kv_dim} "
                         f"{layout.dtype} values")
    if pool.nbytes != shape[0] * shape[1] * shape[2] * layout.torch_dtype.itemsize:
        raise ValueError(f"pool {shape} is not {pool.nbytes} bytes")
    staging = None if nixl.get("staging") is None else RemoteMemory.parse(nixl["staging"], "staging area")
    probe = RemoteMemory.parse(nixl.get("probe"), "probe")
    if not 0 < probe.nbytes <= _PROBE_BYTES:
        raise ValueError(f"the probe is {probe.nbytes} bytes, not 1 to {_PROBE_BYTES}")
    return DecodeMemory(metadata, pool, tuple(shape), staging, probe)


class NixlPairing(SendPairing):
    """One NIXL agent per sender (made here, so a missing NIXL stops the worker at start with the extra to install)
    and its arena, made at the first pairing. `backend`: NIXL's backend (UCX; UCX picks its transports from UCX_TLS
    and its other variables in this process's environment). `arena_bytes`: the registered memory rows wait in."""

    def __init__(self, sender, backend: str = "UCX", arena_bytes: int = DEFAULT_SEND_ARENA_BYTES):
        super().__init__(sender)
        if arena_bytes <= 0:
            raise ValueError(f"arena_bytes={arena_bytes} must be positive")
        self.agent = NixlAgent(f"pdserve-prefill-{uuid.uuid4().hex[:12]}", backend)
        self.arena_bytes = arena_bytes
        self._arena: Optional[Arena] = None
        self._probe: Optional[Registered] = None  # what each pairing's first WRITE reads
        self._lock = threading.Lock()
        # WRITEs that never resolved after their connection ended, with the memory they may still read: kept as
        # long as this sender, so that memory is never handed out again.
        self.leaked: list[tuple[Any, Any]] = []

    def arena(self) -> Arena:
        with self._lock:
            if self._arena is None:
                self._arena = Arena(self.agent, self.arena_bytes, self.sender.device)
                self._probe_source = torch.zeros(_PROBE_BYTES, dtype=torch.uint8, device=self.sender.device)
                self._probe = self.agent.register(self._probe_source)
            return self._arena

    def open(self, endpoint: str, sock: Any, hello_ok: dict[str, Any]) -> SendPlane:
        if hello_ok.get("transport", NIXL) != NIXL:
            raise ProtocolError(f"HELLO_OK chose transport {hello_ok.get('transport')!r}; this sender asked for nixl")
        try:
            decode = parse_hello_ok(hello_ok, self.sender.layout)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        arena = self.arena()
        try:
            peer = self.agent.add_peer(decode.metadata)
        except Exception as e:  # noqa: BLE001 (NIXL raises its own types)
            raise KVTransferError("unreachable", f"NIXL could not connect to decode KV endpoint {endpoint}'s agent: "
                                                 f"{e}") from None
        try:
            ucx = self._first_write(endpoint, peer, decode.probe)
        except BaseException:
            self.agent.remove_peer(peer)
            raise
        logger.info("KV pair with decode %s: over nixl (UCX: %s), its pool %s %s", endpoint, ucx, decode.pool_shape,
                    decode.pool.mem_type)
        return NixlSendPlane(self, peer, ucx, decode, arena, announce_in_aux=bool(hello_ok.get("aux_layers")))

    def _first_write(self, endpoint: str, peer: str, probe: RemoteMemory) -> str:
        """One small WRITE into the decode worker's probe: the pairing's data path works before any room relies on
        it, its set-up cost is paid here rather than by the first room, and UCX has picked (and printed) its
        transports for writes between these memories: what this returns."""
        src = self._probe
        local_mem = src.mem_type
        what = f"decode KV endpoint {endpoint}: a first NIXL WRITE into its memory"
        try:
            xfer = self.agent.write(peer, [(src.addr, probe.nbytes, src.device)],
                                    [(probe.addr, probe.nbytes, probe.device)], local_mem, probe.mem_type, b"")
        except Exception as e:  # noqa: BLE001 (NIXL refused the descriptors or could not post them)
            raise KVTransferError("unreachable", f"{what} could not start: {e}") from None
        deadline = time.monotonic() + self.sender.connect_timeout_s
        while (state := self.agent.state(xfer)) == "PROC" and time.monotonic() < deadline:
            time.sleep(_POLL_SLEEP_S)
        ucx = self.agent.transport(peer, local_mem, probe.mem_type)
        if state != "DONE":
            if state == "PROC":
                self.leaked.append((xfer, None))  # its source is the probe, registered for the sender's life
            else:
                self.agent.release(xfer)
            raise KVTransferError("unreachable", f"{what} {'failed' if state == 'ERR' else 'did not complete'} "
                                                 f"(UCX: {ucx})")
        self.agent.release(xfer)
        return ucx

    def close(self) -> None:
        self.agent.close()


class _NixlGrant(Grant):
    """A room's side of the pairing: its grant and where it writes."""

    def __init__(self):
        super().__init__()
        self.staging: Optional[int] = None  # offset of the room's block in the decode worker's staging area
        self.runs: Optional[tuple[tuple[int, int, int], ...]] = None  # page runs of the room (in place), at GRANT


class _Rows:
    """A run of one send's layers `(layers, tokens, kv_dim)`, `first` its first layer: in an arena block, or (no room
    in the arena when gathered) in a plain tensor the writer moves into one."""

    def __init__(self, layers: list[int], rows: torch.Tensor, block: Optional[Block], ready: Any):
        self.layers, self.rows, self.block, self.ready = layers, rows, block, ready


class NixlSendPlane(SendPlane):
    """The rows of each `send` in one WRITE into the decode worker's registered memory; the frames announce them."""

    name, writes_pages = NIXL, True
    # Layer by layer as the forward writes them: between hosts the link is slower than the forward, so each layer's
    # WRITE overlaps the layers still being computed.
    streams_layers = True

    def __init__(self, pairing: NixlPairing, peer: str, ucx: str, decode: DecodeMemory, arena: Arena,
                 announce_in_aux: bool = False):
        self.pairing, self.agent, self.peer, self.ucx = pairing, pairing.agent, peer, ucx
        self.announce_in_aux = announce_in_aux  # the decode worker takes a room's last layers in its AUX frame
        self.pool, self.pool_shape, self.staging, self.arena = decode.pool, decode.pool_shape, decode.staging, arena
        self.device = arena.tensor.device
        self.local_mem = "VRAM" if self.device.type == "cuda" else "DRAM"
        self._abandoned: list[tuple[Any, Any]] = []  # (WRITE, what it reads) left in flight when the link broke

    # ---- the caller's thread ----

    def open_room(self, handle: RoomHandle) -> None:
        handle.link = self.ucx
        open_granted(self.conn, handle, self.pool_shape, _NixlGrant())

    def send(self, handle: RoomHandle, layers: list[int], source: torch.Tensor,
             slots: Optional[torch.Tensor]) -> None:
        src = source if source.dim() == 3 else source[None]  # (layers, slots or tokens, kv_dim)
        # A large send (a whole prompt at once) goes as a few WRITEs of runs of layers, issued together: each starts
        # once its own run is gathered, while the next run is gathered, and none waits for another to complete. A run
        # is at most half the arena (a long prompt's rows would not fit it at once).
        layer_bytes = handle.num_tokens * src.shape[-1] * src.element_size()
        runs = chunk_count(len(layers) * layer_bytes) if self.device.type == "cuda" else 1
        step = max(1, min(self.arena.nbytes // 2 // layer_bytes, -(-len(layers) // runs)))
        items = [self._gather(handle, layers[first:first + step], src[first:first + step], slots)
                 for first in range(0, len(layers), step)]
        announce = not (self.announce_in_aux and handle.all_sent)
        if not announce:
            handle.aux_layers.extend(layers)  # the AUX frame, queued behind these WRITEs, announces them
        self.conn.queue.put((handle, LAYER, lambda: self._write(handle, items, announce), None))

    def _gather(self, handle: RoomHandle, layers: list[int], src: torch.Tensor, slots: Optional[torch.Tensor]) -> _Rows:
        n = handle.num_tokens
        shape = (len(layers), n, src.shape[-1])
        block = self.arena.take(shape[0] * n * shape[2] * src.element_size())
        if block is not None:
            rows = block.view(shape, src.dtype)
            if slots is None:
                rows.copy_(src)
            else:
                torch.index_select(src.detach(), 1, slots.to(src.device), out=rows)
        else:  # the arena is full of rows still to be written: the writer moves these in once it has room
            rows = src.detach().index_select(1, slots.to(src.device)) if slots is not None else src.detach().clone()
        ready = None
        if rows.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(rows.device))
            if block is not None:
                block.ready = ready
        return _Rows(layers, rows, block, ready)

    def failed(self, handle: RoomHandle, local: bool) -> None:
        # Written after every WRITE of the room resolved: the decode worker frees the room's memory on it.
        fail_granted(self.conn, handle)

    # ---- the connection's threads ----

    def on_reply(self, header: dict[str, Any], handle: Optional[RoomHandle]) -> bool:
        return on_grant(header, handle, self._plan, staging=lambda v: v is None or isinstance(v, int) and v >= 0)

    @staticmethod
    def _plan(handle: RoomHandle, grant: _NixlGrant) -> None:
        # At the GRANT (the reader thread, while the prompt computes): page_runs is a Python loop over the pages.
        if grant.staging is None:
            grant.runs = plan_pages(handle.dst_pages, grant.tokens, handle.layout.page_size).runs

    def _write(self, handle: RoomHandle, items: list[_Rows], announce: bool = True) -> Any:
        """Writer thread: every run of the send WRITTEN into the room's granted memory, the WRITEs in flight together,
        each announced (a LAYER frame) as soon as it is DONE, in order; returns the last run's frame (written by the
        writer loop; [] when `announce` is False: the AUX frame announces them), or None when the room failed instead
        (after every WRITE it started resolved)."""
        if not await_grant(handle, items[0].rows.shape[1]):
            return None
        inflight: list[tuple[_Rows, Any, Any]] = []  # (run, its WRITE, what keeps the WRITE's source valid)
        frames: list[Any] = []  # announcements of the runs DONE, the last one not written yet
        for item in items:
            if item.block is None and inflight:  # its rows wait for the arena room the WRITEs in flight hold
                if not self._resolve(handle, inflight, frames, announce):
                    return None
                inflight = []
            try:
                xfer, holder = self._start(handle, item)
            except KVTransferError as e:
                self._resolve(handle, inflight, frames, announce)
                handle._fail(e.kind, e.message)
                return None
            if xfer is None:
                self._resolve(handle, inflight, frames, announce)
                return None
            inflight.append((item, xfer, holder))
        if not self._resolve(handle, inflight, frames, announce):
            return None
        return frames[-1] if announce else []

    def _resolve(self, handle: RoomHandle, inflight: list[tuple[_Rows, Any, Any]], frames: list[Any],
                 announce: bool = True) -> bool:
        """Wait for every WRITE of `inflight` in order (each runs to its end or its error even when its room failed:
        the room's ABORT must come after them all), announcing each run once it is DONE (the one before it is written
        then, the last left in `frames`); True when all are DONE and the room still stands."""
        ok = True
        for item, xfer, holder in inflight:
            state = self._wait(xfer)
            if state == "PROC":  # the connection broke while the WRITE was in flight: it may still read `holder`
                self._abandoned.append((xfer, holder))
                ok = False
                continue
            self.agent.release(xfer)
            item.block = None  # its arena block goes back once `inflight` lets go of the WRITE's holder too
            if state != "DONE":
                self.conn.break_(KVTransferError("peer_failed", f"room {handle.room}: the NIXL WRITE to decode KV "
                                                                f"endpoint {self.conn.endpoint} failed (UCX: "
                                                                f"{self.ucx})"))
                ok = False
                continue
            handle.bytes_sent += item.rows.numel() * item.rows.element_size()
            if not ok or handle.status.state == TransferState.FAILED:
                ok = False
                continue
            if not announce:
                continue
            if frames and not self.conn.write_now(frames.pop()):  # the run before it: the decode worker lands it now
                ok = False
                continue
            layers = item.layers
            header = {"layer": layers[0]} if len(layers) == 1 else {"layers": layers}
            frames.append(self.conn.frame(handle, LAYER, {**header, "num_tokens": item.rows.shape[1]}))
        return ok and handle.status.state != TransferState.FAILED

    def _start(self, handle: RoomHandle, item: _Rows) -> tuple[Any, Any]:
        """Post the WRITE of one run: (WRITE, what keeps its source valid), or (None, None) when the connection broke
        instead. Raises KVTransferError for a room that cannot go."""
        grant: _NixlGrant = handle.plane_state
        rows, layers = item.rows, item.layers
        n, row_bytes = rows.shape[1], rows.shape[2] * rows.element_size()
        nbytes = rows.numel() * rows.element_size()
        if grant.staging is not None:
            room_bytes = handle.num_layers * n * row_bytes
            if self.staging is None or grant.staging + room_bytes > self.staging.nbytes:
                raise KVTransferError("protocol", f"room {handle.room}: GRANT names staging at {grant.staging} for "
                                                  f"{room_bytes} bytes, outside the decode worker's staging area")
            first = grant.staging + layers[0] * n * row_bytes  # the room's block is (num_layers, tokens, kv_dim)
            remote = [(self.staging.addr + first, nbytes, self.staging.device)]
            remote_mem = self.staging.mem_type
        else:
            layer_bytes = self.pool_shape[1] * row_bytes
            remote = [(self.pool.addr + layer * layer_bytes + slot * row_bytes, count * row_bytes, self.pool.device)
                      for layer in layers for _, slot, count in grant.runs]
            remote_mem = self.pool.mem_type
        source, holder = self._registered(handle, item)
        base = source.data_ptr()
        if grant.staging is not None:
            local: list[Region] = [(base, nbytes, device_id(source))]
        else:
            local = [(base + (i * n + first_row) * row_bytes, count * row_bytes, device_id(source))
                     for i in range(len(layers)) for first_row, _, count in grant.runs]
        try:
            return self.agent.write(self.peer, local, remote, self.local_mem, remote_mem, b""), holder
        except Exception as e:  # noqa: BLE001 (NIXL refused the descriptors or could not post them)
            self.conn.break_(KVTransferError("peer_failed", f"room {handle.room}: NIXL could not WRITE its rows to "
                                                            f"decode KV endpoint {self.conn.endpoint}: {e}"))
            return None, None

    def _registered(self, handle: RoomHandle, item: _Rows) -> tuple[torch.Tensor, Any]:
        """The rows in registered memory, and what keeps that memory valid while a WRITE reads it."""
        rows = item.rows
        if item.block is not None:
            if item.ready is not None:
                item.ready.synchronize()  # the gather into the block (NIXL reads the memory, not the stream)
            return rows, item.block
        if item.ready is not None:
            item.ready.synchronize()
        nbytes = rows.numel() * rows.element_size()
        give_up = time.monotonic() + _ARENA_WAIT_S
        while (block := self.arena.take(nbytes)) is None:  # the arena frees as this and other writers finish
            if nbytes > self.arena.nbytes or time.monotonic() >= give_up:  # registered for this WRITE alone
                return rows, _OwnRegistration(self.agent, rows)
            if self.conn.broken is not None:
                raise self.conn.broken
            time.sleep(_POLL_SLEEP_S * 10)
        staged = block.view(rows.shape, rows.dtype)
        staged.copy_(rows)
        if staged.device.type == "cuda":
            torch.cuda.current_stream(staged.device).synchronize()
        return staged, block

    def _wait(self, xfer: Any) -> str:
        """The WRITE's state once it resolved ('DONE' or 'ERR'), or 'PROC' when the connection broke first (a WRITE
        runs to its end or its error even when its room failed: the room's ABORT must come after it)."""
        spin_until = time.monotonic() + _POLL_SPIN_S
        while (state := self.agent.state(xfer)) == "PROC":
            if self.conn.broken is not None:
                return state
            if time.monotonic() > spin_until:
                time.sleep(_POLL_SLEEP_S)
        return state

    def ended(self) -> None:
        deadline = time.monotonic() + _ABANDONED_WAIT_S
        for xfer, holder in self._abandoned:
            while self.agent.state(xfer) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
            if self.agent.state(xfer) == "PROC":
                # NOTE: its memory stays with the WRITE (the arena block is never handed out again).
                logger.warning("KV connection to %s ended with a NIXL WRITE still in flight after %g s",
                               self.conn.endpoint, _ABANDONED_WAIT_S)
                self.pairing.leaked.append((xfer, holder))
                continue
            self.agent.release(xfer)
        self._abandoned.clear()
        self.agent.remove_peer(self.peer)


class _OwnRegistration:
    """Rows too large for the arena, registered for their one WRITE and deregistered once nothing reads them."""

    def __init__(self, agent: NixlAgent, rows: torch.Tensor):
        self.agent, self.rows, self.registered = agent, rows, agent.register(rows)

    def __del__(self):
        self.agent.deregister(self.registered)


__all__ = ["NIXL", "DecodeMemory", "NixlPairing", "NixlSendPlane", "RemoteMemory", "parse_hello_ok"]
