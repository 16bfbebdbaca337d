"""Prefill side of "cuda_ipc" and "auto": the pairing (what HELLO tells the decode worker, the mapping of its pool
HELLO_OK hands over) and the data plane that copies the rows into the reserved pages of that mapped pool.

Ordering. `send_layers` (the prefill engine's call: every layer of a prompt at once, after its forward; these
pairings do not stream layer by layer) or `send_rows` (one layer) gathers the rows on the caller's stream (the
forward that wrote them is before it) and records an event. The connection's writer thread, in queue order: waits for
the room's GRANT, checks the token count against it, queues the copy into the mapped pool on the pairing's side
stream behind that event (for all the layers: one scatter by page plus one copy for a partial last page, or one copy
when the pages are one run: `scatter_pages`), then writes one LAYER announcement naming the layers. The prefill
engine's thread never waits for the GPU. The AUX frame and an ABORT go out only after the writer synchronised the
room's last copy (`drain`), so each tells the decode worker that nothing of the room is still being written.

Bounds. Every destination page is checked against the mapped pool's size at `begin`; rows are only written after
the decode worker granted the room (it checked the pages against its reservation) and only as many as it granted.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import torch

from .base import KVTransferError, TransferState, gather_layers
from .control_sender import RoomHandle
from .cuda_ipc_pairing import AUTO, IPC, TCP, IpcBackend, check_export, pool_slots
from .pages import PagePlan, copy_across, plan_pages, scatter_pages
from .plane import PairAgain, SendPairing, SendPlane
from .tcp import TcpSendPlane
from .wire import ABORT, BEGIN, GRANT, LAYER, ProtocolError

logger = logging.getLogger(__name__)


class IpcPairing(SendPairing):
    """`ipc`: the GPU facts and calls (`IpcBackend`; the CPU tests pass fakes)."""

    def __init__(self, sender, ipc: Optional[IpcBackend] = None):
        super().__init__(sender)
        self._ipc = ipc or IpcBackend()
        self._facts = self._ipc.local_facts(sender.device)
        self._tcp_only: dict[str, str] = {}  # endpoint -> why mapping its pool failed (auto: tcp from then on)

    def hello(self, endpoint: str) -> dict[str, Any]:
        return {"transport": TCP if endpoint in self._tcp_only else self.sender.transport,
                "ipc_facts": self._facts.to_dict()}

    def open(self, endpoint: str, sock: Any, hello_ok: dict[str, Any]) -> SendPlane:
        wants = self.sender.transport
        mode, why = hello_ok.get("transport", TCP), hello_ok.get("reason", "the decode worker chose it")
        if mode == TCP and wants == AUTO:
            logger.info("KV pair with decode %s: over tcp (%s)", endpoint, why)
            return TcpSendPlane()
        if mode != IPC:
            raise ProtocolError(f"HELLO_OK chose transport {mode!r}; this sender asked for {wants}")
        try:
            check_export(hello_ok.get("ipc"), self.sender.layout)
            remote = self._ipc.open(hello_ok["ipc"], self.sender.layout.torch_dtype)
        except (RuntimeError, ValueError, TypeError) as e:  # TypeError: torch refused the fields' types
            message = f"decode KV endpoint {endpoint}'s pool cannot be mapped here: {e}"
            if wants != AUTO:
                raise KVTransferError("unreachable", message) from None
            # auto: this pool cannot be mapped from here (another container, a driver refusal): tcp with it
            logger.warning("KV pair with decode %s: cuda_ipc offered but mapping its pool failed (%s); pairing over "
                           "tcp", endpoint, message)
            self._tcp_only[endpoint] = message
            raise PairAgain(message) from None
        logger.info("KV pair with decode %s: over cuda_ipc (%s), its pool %s mapped on %s", endpoint, why,
                    tuple(remote.shape), remote.device)
        return IpcSendPlane(remote, self.sender.device)


class _Grant:
    """A room's side of the pairing: the pages the decode worker granted, and its last queued copy."""

    def __init__(self):
        self.granted = threading.Event()
        self.tokens: Optional[int] = None
        self.plan: Optional[PagePlan] = None  # where the rows go, made at the first copy
        self.last_copy: Any = None  # CUDA event after the room's last queued copy


class IpcSendPlane(SendPlane):
    """The decode pool mapped into this process; the rows are copied into its pages, the frames only announce them.
    The mapping goes when both threads of the connection ended."""

    name, writes_pages = IPC, True
    # All of a prompt's layers in one gather, one copy and one announcement (`send_layers`): the rows move on the
    # GPU in microseconds, so streaming them layer by layer would only cost the prefill engine's thread a gather, an
    # event and a frame per layer and prompt (a visible share of that thread under load).
    streams_layers = False

    def __init__(self, remote: torch.Tensor, device: torch.device):
        self.remote = remote  # the decode pool (layers, slots, kv_dim), mapped
        # NOTE: on the rows' GPU: across GPUs torch runs the peer copy on the source device's current stream; the
        # scatter runs on the pool's GPU, on a stream of its own there (the same stream on one GPU).
        on_gpus = device.type == "cuda" and remote.device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_gpus else None
        across = on_gpus and remote.device != device
        self.pool_stream = torch.cuda.Stream(remote.device) if across else self.stream
        self.stage_stream = torch.cuda.Stream(remote.device) if across else None  # see pages.copy_across

    # ---- the caller's thread ----

    def open_room(self, handle: RoomHandle) -> None:
        try:
            # NOTE: a page outside the pool is refused here. Nothing later checks on the host: an index past the
            # pool in scatter_pages' index_copy_ is a device-side assert, which ends this process's CUDA context.
            pool_slots(self.remote.shape, handle.dst_pages, handle.layout.page_size)
        except ValueError as e:  # pages from the peer that do not fit its own pool
            raise KVTransferError("protocol", f"room {handle.room}: {e}") from None
        handle.plane_state = _Grant()
        self.conn.put(handle, BEGIN, {"num_layers": handle.num_layers, "pages": handle.dst_pages})

    def send(self, handle: RoomHandle, layers: list[int], source: torch.Tensor,
             slots: Optional[torch.Tensor]) -> None:
        """Queue the copy of the rows ((num_tokens, kv_dim) for one layer, (len(layers), num_tokens, kv_dim) for a
        run of them), gathered into memory the transport owns, so the caller may reuse the pool at once."""
        rows = gather_layers(source, slots)  # (num_tokens, kv_dim) for one layer, (layers, num_tokens, kv_dim)
        ready = None
        if rows.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(rows.device))
        n = rows.shape[-2]
        header = {"layer": layers[0], "num_tokens": n} if len(layers) == 1 else {"layers": layers, "num_tokens": n}

        def build():
            if not self._write(handle, layers, rows, ready):
                return None
            return self.conn.frame(handle, LAYER, header)

        self.conn.queue.put((handle, LAYER, build, None))

    def failed(self, handle: RoomHandle, local: bool) -> None:
        if handle.plane_state is not None:
            handle.plane_state.granted.set()  # a writer waiting for the grant moves on (and finds the room failed)
        if self.conn.broken is None:
            # Written after the room's copies were synchronised (`drain`): the decode worker frees the pages on it.
            self.conn.put(handle, ABORT, {})

    # ---- the connection's threads ----

    def on_reply(self, header: dict[str, Any], handle: Optional[RoomHandle]) -> bool:
        if header.get("kind") != GRANT:
            return False
        n = header.get("num_tokens")
        if not (isinstance(n, int) and n > 0):
            raise ProtocolError(f"GRANT without a token count: {str(header)[:200]}")
        if handle is not None and handle.plane_state is not None:
            handle.plane_state.tokens = n
            handle.plane_state.granted.set()
        return True

    def drain(self, handle: RoomHandle) -> None:
        """Wait (writer thread) until every copy of the room queued so far has completed."""
        if handle.plane_state is not None and handle.plane_state.last_copy is not None:
            handle.plane_state.last_copy.synchronize()

    def _write(self, handle: RoomHandle, layers: list[int], rows: torch.Tensor, ready: Any) -> bool:
        """On the writer thread: queue the layers' copy into the granted pages; False when the room failed instead."""
        grant: _Grant = handle.plane_state
        if not grant.granted.wait(max(0.0, handle.deadline - time.monotonic())):
            handle._expire(handle.timeout_s)
            return False
        if handle.status.state == TransferState.FAILED:
            return False
        n = rows.shape[-2]
        if n != grant.tokens:
            handle._fail("protocol", f"room {handle.room}: prefill has {n} tokens, the decode worker reserved "
                                     f"{grant.tokens}")
            return False
        remote, stream = self.remote, self.stream
        # (layers are consecutive: one layer, or send_layers' run)
        target = remote[layers[0]] if rows.dim() == 2 else remote[layers[0]:layers[-1] + 1]
        try:
            if stream is None:  # a CPU pool (the CPU tests' fake mapping): the same arithmetic, synchronous
                scatter_pages(target, rows, self._plan_for(grant, handle, rows))
                handle.bytes_sent += rows.numel() * rows.element_size()
                return True
            pool_stream, stage_stream = self.pool_stream, self.stage_stream
            if stage_stream is None:  # one GPU
                with torch.cuda.stream(stream):
                    plan = self._plan_for(grant, handle, rows)  # its index is made on (and only used on) this stream
                    stream.wait_event(ready)
                    scatter_pages(target, rows, plan)
            else:  # the pool's device's current stream, then the rows': across GPUs both are set at once
                with torch.cuda.stream(stage_stream), torch.cuda.stream(stream):
                    plan = self._plan_for(grant, handle, rows)  # made on the stage stream, ahead of every scatter
                    stream.wait_event(ready)
                    copy_across(target if rows.dim() == 3 else target[None], rows if rows.dim() == 3 else rows[None],
                                plan, pool_stream)
            done = torch.cuda.Event()
            done.record(pool_stream)
            rows.record_stream(stream)  # the allocator must not hand its memory out before the copy read it
            grant.last_copy = done
        except RuntimeError as e:  # the mapping or the device failed: this pairing cannot be trusted
            self.conn.break_(KVTransferError("peer_failed", f"copying room {handle.room}'s rows into decode KV "
                                                            f"endpoint {self.conn.endpoint}'s pool failed: {e}"))
            return False
        handle.bytes_sent += rows.numel() * rows.element_size()
        return True

    def _plan_for(self, grant: _Grant, handle: RoomHandle, rows: torch.Tensor) -> PagePlan:
        # Once per room, at its first layer (every layer has the granted count, checked above): page_runs is a
        # Python loop over the pages, too slow to repeat for every layer on the writer thread.
        if grant.plan is None:
            grant.plan = plan_pages(handle.dst_pages, rows.shape[-2], handle.layout.page_size, self.remote.device)
        return grant.plan

    def ended(self) -> None:
        # NOTE: the writer thread is gone, so nothing queues copies any more; wait for the queued ones, then drop
        # the mapping (torch closes the IPC handle with the last tensor on it).
        try:
            if self.stream is not None:
                self.stream.synchronize()
                self.pool_stream.synchronize()
                if self.stage_stream is not None:
                    self.stage_stream.synchronize()
        except RuntimeError as e:
            logger.warning("KV connection to %s: waiting for its last copies failed: %s", self.conn.endpoint, e)
        self.remote = None
