"""Prefill side of "cuda_ipc" and "auto": the pairing (what HELLO tells the decode worker, the mapping of its pool
HELLO_OK hands over) and the data plane that copies the rows into the reserved pages of that mapped pool.

Ordering. `send_layers` (the prefill engine's call: every layer of a prompt at once, after its forward; these
pairings do not stream layer by layer) or `send_rows` (one layer) gathers the rows on the caller's stream (the
forward that wrote them is before it), across GPUs in a few runs of layers with an event after each
(`pages.gather_chunks`). Their copy into the mapped pool is queued behind those events on the pairing's side streams
(across GPUs: each run crosses the link, then is scattered into the pages on the pool's GPU while the next crosses,
`pages.copy_across`; on one GPU one scatter by page, or one copy when the pages are one run: `scatter_pages`) by the
caller's thread when the room was granted already (the stack opens a room while its prompt computes), otherwise by
the connection's writer thread once GRANT came (in queue order, a room's later sends behind it too); then one LAYER
announcement naming the layers, except for the send that completes the room where the decode worker takes its
layers in the AUX frame (HELLO_OK's `aux_layers`): finish() follows it, so a whole prompt is BEGIN, GRANT, AUX. The
page plan is made when the GRANT arrives (the reader thread), not by the first send. The prefill engine's thread
never waits for the GPU. The AUX frame and an ABORT go out only after the writer synchronised the room's last copy
(`drain`), so each tells the decode worker that nothing of the room is still being written.

Bounds. Every destination page is checked against the mapped pool's size at `begin`; rows are only written after
the decode worker granted the room (it checked the pages against its reservation) and only as many as it granted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Optional

import torch

from .base import KVTransferError
from .control_sender import RoomHandle
from .cuda_ipc_pairing import AUTO, IPC, TCP, IpcBackend, check_export
from .grants import Grant, await_grant, fail_granted, on_grant, open_granted
from .pages import Chunk, PagePlan, chunk_count, copy_across, gather_chunks, plan_pages, scatter_pages
from .plane import PairAgain, SendPairing, SendPlane
from .tcp import TcpSendPlane
from .wire import LAYER, ProtocolError

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
        return IpcSendPlane(remote, self.sender.device, announce_in_aux=bool(hello_ok.get("aux_layers")))


class _IpcGrant(Grant):
    """A room's side of the pairing: its grant, its page plan and its last queued copy."""

    def __init__(self):
        super().__init__()
        self.plan: Optional[PagePlan] = None  # where the rows go, made when the GRANT came
        self.last_copy: Any = None  # CUDA event after the room's last queued copy
        self.queued = 0  # sends of the room whose copies wait for the writer thread (the plane's lock held)


class IpcSendPlane(SendPlane):
    """The decode pool mapped into this process; the rows are copied into its pages, the frames only announce them.
    The mapping goes when both threads of the connection ended."""

    name, writes_pages = IPC, True
    # All of a prompt's layers in one gather, one copy and one announcement (`send_layers`): the rows move on the
    # GPU in microseconds, so streaming them layer by layer would only cost the prefill engine's thread a gather, an
    # event and a frame per layer and prompt (a visible share of that thread under load).
    streams_layers = False

    def __init__(self, remote: torch.Tensor, device: torch.device, announce_in_aux: bool = False):
        self.remote = remote  # the decode pool (layers, slots, kv_dim), mapped
        self.pool_device = remote.device
        self.announce_in_aux = announce_in_aux  # the decode worker takes a room's last layers in its AUX frame
        # NOTE: on the rows' GPU: across GPUs torch runs the peer copy on the source device's current stream; the
        # scatter runs on the pool's GPU, on a stream of its own there (the same stream on one GPU).
        on_gpus = device.type == "cuda" and remote.device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_gpus else None
        self.across = on_gpus and remote.device != device
        self.pool_stream = torch.cuda.Stream(remote.device) if self.across else self.stream
        self.stage_stream = torch.cuda.Stream(remote.device) if self.across else None  # see pages.copy_across
        # Held while copies are queued (by the writer thread, or the caller's once its room is granted) and while the
        # mapping is let go: no copy is queued into a mapping being closed.
        self._lock = threading.Lock()

    # ---- the caller's thread ----

    def open_room(self, handle: RoomHandle) -> None:
        # NOTE: a page outside the pool is refused here. Nothing later checks on the host: an index past the pool in
        # scatter_pages' index_copy_ is a device-side assert, which ends this process's CUDA context.
        open_granted(self.conn, handle, self.remote.shape, _IpcGrant())

    def send(self, handle: RoomHandle, layers: list[int], source: torch.Tensor,
             slots: Optional[torch.Tensor]) -> None:
        """Gather the rows ((num_tokens, kv_dim) for one layer, (len(layers), num_tokens, kv_dim) for a run of them)
        into memory the transport owns, so the caller may reuse the pool at once, and queue their copy: from this
        thread when the room is already granted (the stack opens it while the prompt computes), so the copy starts
        without waiting for the writer thread; from the writer thread once the grant came otherwise."""
        run = source if source.dim() == 3 else source[None]  # (layers, slots or tokens, kv_dim)
        n = handle.num_tokens
        row_bytes = len(layers) * n * run.shape[-1] * run.element_size()
        chunks = gather_chunks(run, slots, chunk_count(row_bytes) if self.across else 1)
        announce = not (self.announce_in_aux and handle.all_sent)
        if not announce:
            handle.aux_layers.extend(layers)  # the AUX frame, written after this copy completed, announces them
        header = {"layer": layers[0], "num_tokens": n} if len(layers) == 1 else {"layers": layers, "num_tokens": n}
        grant: _IpcGrant = handle.plane_state
        with self._lock:
            direct = grant.granted.is_set() and grant.queued == 0
            if not direct:
                grant.queued += 1
        if direct:
            if self._write(handle, layers, chunks) and announce:
                self.conn.put(handle, LAYER, header)
            return

        def build():
            try:
                if not self._write(handle, layers, chunks):
                    return None
            finally:
                with self._lock:
                    grant.queued -= 1
            return self.conn.frame(handle, LAYER, header) if announce else []

        self.conn.queue.put((handle, LAYER, build, None))

    def failed(self, handle: RoomHandle, local: bool) -> None:
        # The ABORT is written after the room's copies were synchronised (`drain`): the decode worker frees the pages.
        fail_granted(self.conn, handle)

    # ---- the connection's threads ----

    def on_reply(self, header: dict[str, Any], handle: Optional[RoomHandle]) -> bool:
        return on_grant(header, handle, self._plan)

    def _plan(self, handle: RoomHandle, grant: _IpcGrant) -> None:
        """The room's page plan, made once when its GRANT arrives (the reader thread, while the prompt computes):
        page_runs is a Python loop over the pages, and the index of scattered pages a copy to the device. Its index
        is made on the stream of the scatters (which only ever read it there)."""
        try:
            with torch.cuda.stream(self.pool_stream) if self.pool_stream is not None else contextlib.nullcontext():
                grant.plan = plan_pages(handle.dst_pages, grant.tokens, handle.layout.page_size, self.pool_device)
        except RuntimeError as e:  # the device failed: this pairing cannot be trusted
            self.conn.break_(KVTransferError("peer_failed", f"planning room {handle.room}'s copy into decode KV "
                                                            f"endpoint {self.conn.endpoint}'s pool failed: {e}"))

    def drain(self, handle: RoomHandle) -> None:
        """Wait (writer thread) until every copy of the room queued so far has completed."""
        if handle.plane_state is not None and handle.plane_state.last_copy is not None:
            handle.plane_state.last_copy.synchronize()

    def _write(self, handle: RoomHandle, layers: list[int], chunks: list[Chunk]) -> bool:
        """Queue the layers' copy into the granted pages (the writer thread, or the caller's once granted); False
        when the room failed instead."""
        n = chunks[0].rows.shape[-2]
        if not await_grant(handle, n):
            return False
        grant: _IpcGrant = handle.plane_state
        with self._lock:
            if self.remote is None:  # the connection ended meanwhile (its rooms failed with it)
                return False
            target = self.remote  # (layers are consecutive: one layer, or a run; a whole pool's needs no slice)
            if layers[0] != 0 or len(layers) != target.shape[0]:
                target = target[layers[0]:layers[-1] + 1]
            try:
                self._copy(grant, handle, target, chunks)
            except RuntimeError as e:  # the mapping or the device failed: this pairing cannot be trusted
                self.conn.break_(KVTransferError("peer_failed", f"copying room {handle.room}'s rows into decode KV "
                                                                f"endpoint {self.conn.endpoint}'s pool failed: {e}"))
                return False
        handle.bytes_sent += sum(c.rows.numel() * c.rows.element_size() for c in chunks)
        return True

    def _copy(self, grant: _IpcGrant, handle: RoomHandle, target: torch.Tensor, chunks: list[Chunk]) -> None:
        stream, plan = self.stream, grant.plan  # (planned at the GRANT, for the count every send was checked against)
        if stream is None:  # a CPU pool (the CPU tests' fake mapping): the same arithmetic, synchronous
            for c in chunks:
                scatter_pages(_layers_of(target, c), c.rows, plan)
            return
        if self.stage_stream is None:  # one GPU
            with torch.cuda.stream(stream):
                for c in chunks:
                    stream.wait_event(c.ready)
                    scatter_pages(_layers_of(target, c), c.rows, plan)
                    c.rows.record_stream(stream)  # the allocator must not hand it out before the copy read it
        else:  # the pool's device's current stream, then the rows': across GPUs both are set at once
            with torch.cuda.stream(self.stage_stream), torch.cuda.stream(stream):
                copy_across(target, chunks, plan, self.pool_stream)
        done = torch.cuda.Event()
        done.record(self.pool_stream)
        grant.last_copy = done

    def ended(self) -> None:
        # NOTE: the writer thread is gone and the lock keeps a caller from queueing more; wait for the queued copies,
        # then drop the mapping (torch closes the IPC handle with the last tensor on it).
        with self._lock:
            try:
                if self.stream is not None:
                    self.stream.synchronize()
                    self.pool_stream.synchronize()
                    if self.stage_stream is not None:
                        self.stage_stream.synchronize()
            except RuntimeError as e:
                logger.warning("KV connection to %s: waiting for its last copies failed: %s", self.conn.endpoint, e)
            self.remote = None


def _layers_of(target: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The layers of `target` a chunk's rows go to (`target` itself when they are all of them: no slice to make)."""
    if chunk.first == 0 and chunk.rows.shape[0] == target.shape[0]:
        return target
    return target[chunk.first:chunk.first + chunk.rows.shape[0]]
