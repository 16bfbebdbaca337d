"""Prefill side of "cuda_ipc" and "auto": the TCP sender's control connection, plus, where the handshake chose
cuda_ipc, the decode pool mapped into this process, into whose reserved pages the rows are copied on the GPU.

Ordering. `send_layers` (the prefill engine's call: every layer of a prompt at once, after its forward; these
handles do not stream layer by layer) or `send_rows` (one layer) gathers the rows on the caller's stream (the forward
that wrote them is before it) and records an event. The connection's writer thread, in queue order: waits for the
room's GRANT, checks the token count against it, queues the copy into the mapped pool on the connection's side
stream behind that event (for all the layers: one scatter by page plus one copy for a partial last page, or one
copy when the pages are one run: `scatter_pages`), then writes one LAYER announcement naming the layers. The prefill engine's thread never waits for the GPU. The AUX frame and an ABORT
are built by the writer only after it synchronised the room's last copy, so each tells the decode worker that
nothing of the room is still being written.

Bounds. Every destination page is checked against the mapped pool's size at `begin`; rows are only written after
the decode worker granted the room (it checked the pages against its reservation) and only as many as it granted.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Optional, Sequence

import torch

from .base import KVLayout, KVTransferError, TransferState, gather_layers, gather_rows
from .cuda_ipc_pairing import AUTO, IPC, TCP, IpcBackend, check_export, pool_slots
from .cuda_ipc_receiver import BEGIN, GRANT
from .pages import PagePlan, copy_across, plan_pages, scatter_pages
from .tcp_sender import TcpKVSender, TcpSendHandle, _Connection
from .wire import ABORT, AUX, LAYER, ProtocolError

logger = logging.getLogger(__name__)

class _IpcConnection(_Connection):
    """A control connection and the decode pool it mapped; the mapping goes when both threads ended."""

    transport = IPC

    def __init__(self, endpoint: str, sock: socket.socket, remote: torch.Tensor, device: torch.device,
                 checksum: bool):
        self.remote = remote  # the decode pool (layers, slots, kv_dim), mapped
        # NOTE: on the rows' GPU: across GPUs torch runs the peer copy on the source device's current stream; the
        # scatter runs on the pool's GPU, on a stream of its own there (the same stream on one GPU).
        on_gpus = device.type == "cuda" and remote.device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_gpus else None
        across = on_gpus and remote.device != device
        self.pool_stream = torch.cuda.Stream(remote.device) if across else self.stream
        self.stage_stream = torch.cuda.Stream(remote.device) if across else None  # see pages.copy_across
        super().__init__(endpoint, sock, checksum)

    def _on_reply(self, header: dict[str, Any], handle: Optional[IpcSendHandle]) -> bool:
        if header.get("kind") != GRANT:
            return False
        n = header.get("num_tokens")
        if not (isinstance(n, int) and n > 0):
            raise ProtocolError(f"GRANT without a token count: {str(header)[:200]}")
        if isinstance(handle, IpcSendHandle):
            handle._grant(n)
        return True

    def _ended(self) -> None:
        # NOTE: the writer thread is gone, so nothing queues copies any more; wait for the queued ones, then drop
        # the mapping (torch closes the IPC handle with the last tensor on it).
        try:
            if self.stream is not None:
                self.stream.synchronize()
                self.pool_stream.synchronize()
                if self.stage_stream is not None:
                    self.stage_stream.synchronize()
        except RuntimeError as e:
            logger.warning("KV connection to %s: waiting for its last copies failed: %s", self.endpoint, e)
        while not self.queue.empty():  # closures of frames never written hold rows and handles
            self.queue.get_nowait()
        self.remote = None


class IpcSendHandle(TcpSendHandle):
    """See `SendHandle`: the rows are copied into the decode worker's pages, the frames only announce them."""

    def __init__(self, conn: _IpcConnection, room: int, num_layers: int, layout: KVLayout, timeout_s: float,
                 dst_pages: Sequence[int]):
        super().__init__(conn, room, num_layers, layout, timeout_s)
        pages = list(dst_pages)
        # NOTE: raises ValueError for a page outside the pool. Nothing later checks on the host: an index past the
        # pool in scatter_pages' index_copy_ is a device-side assert, which ends this process's CUDA context.
        pool_slots(conn.remote.shape, pages, layout.page_size)
        self._dst_pages = pages
        self._granted = threading.Event()
        self._grant_tokens: Optional[int] = None
        self._plan: Optional[PagePlan] = None  # where the rows go, made at the first copy
        self._last_copy: Any = None  # CUDA event after the room's last queued copy

    # ---- the caller's thread ----

    def _check_layer(self, layer: int, source: torch.Tensor, slots: Optional[torch.Tensor]) -> int:
        n = super()._check_layer(layer, source, slots)
        if n > len(self._dst_pages) * self.layout.page_size:
            raise ValueError(f"room {self.room}: {n} tokens do not fit the {len(self._dst_pages)} destination "
                             f"pages begin() was given")
        return n

    # All of a prompt's layers in one gather, one copy and one announcement (`send_layers`): the rows move on the
    # GPU in microseconds, so streaming them layer by layer would only cost the prefill engine's thread a gather, an
    # event and a frame per layer and prompt (a visible share of that thread under load).
    streams_layers = False

    def send_layers(self, first_layer: int, source: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
        layers = self._check_layers(first_layer, source, slots)
        if self.status.state == TransferState.FAILED:
            return
        self._queue_rows(layers, gather_layers(source, slots))

    def _queue_layer(self, layer: int, source: torch.Tensor, slots: Optional[torch.Tensor]) -> None:
        self._queue_rows([layer], gather_rows(source, slots, source.device))  # (num_tokens, kv_dim)

    def _queue_rows(self, layers: list[int], rows: torch.Tensor) -> None:
        """Queue the copy of `rows` ((num_tokens, kv_dim) for one layer, (len(layers), num_tokens, kv_dim) for a
        run of them), memory the transport owns, so the caller may reuse the pool at once."""
        ready = None
        if rows.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(rows.device))
        n = rows.shape[-2]
        header = {"layer": layers[0], "num_tokens": n} if len(layers) == 1 else {"layers": layers, "num_tokens": n}

        def build():
            if not self._write(layers, rows, ready):
                return None
            return self._conn._frame(self, LAYER, header)

        self._conn.queue.put((self, LAYER, build, None))

    def _queue_aux(self, header: dict[str, Any], payload: list) -> None:
        def build():
            self._drain()
            return self._conn._frame(self, AUX, header, *payload)

        self._conn.queue.put((self, AUX, build, None))

    def abort(self) -> None:
        self._fail("aborted", f"room {self.room} was aborted by the prefill worker")

    def _expire(self, seconds: float) -> None:
        self._fail("timeout", f"room {self.room}: decode KV endpoint {self._conn.endpoint} did not confirm the "
                              f"transfer within {seconds:g} s")

    # ---- the connection's threads ----

    def _grant(self, num_tokens: int) -> None:
        self._grant_tokens = num_tokens
        self._granted.set()

    def _fail(self, kind: str, message: str) -> bool:
        if not super()._fail(kind, message):
            return False
        self._granted.set()  # a writer waiting for the grant moves on (and finds the room failed)
        if self._conn.broken is None:
            # Built by the writer after it synchronised the room's copies: the decode worker frees the pages on it.
            def build():
                self._drain()
                return self._conn._frame(self, ABORT, {})

            self._conn.queue.put((self, ABORT, build, None))
        return True

    def _write(self, layers: list[int], rows: torch.Tensor, ready: Any) -> bool:
        """On the writer thread: queue the layers' copy into the granted pages; False when the room failed instead."""
        if not self._granted.wait(max(0.0, self._deadline - time.monotonic())):
            self._expire(self._timeout_s)
            return False
        if self.status.state == TransferState.FAILED:
            return False
        n = rows.shape[-2]
        if n != self._grant_tokens:
            self._fail("protocol", f"room {self.room}: prefill has {n} tokens, the decode worker reserved "
                                   f"{self._grant_tokens}")
            return False
        remote, stream = self._conn.remote, self._conn.stream
        # (layers are consecutive: one layer, or send_layers' run)
        target = remote[layers[0]] if rows.dim() == 2 else remote[layers[0]:layers[-1] + 1]
        try:
            if stream is None:  # a CPU pool (the CPU tests' fake mapping): the same arithmetic, synchronous
                scatter_pages(target, rows, self._plan_for(remote, rows))
                return self._counted(rows)
            pool_stream, stage_stream = self._conn.pool_stream, self._conn.stage_stream
            if stage_stream is None:  # one GPU
                with torch.cuda.stream(stream):
                    plan = self._plan_for(remote, rows)  # its index is made on (and only used on) this stream
                    stream.wait_event(ready)
                    scatter_pages(target, rows, plan)
            else:  # the pool's device's current stream, then the rows': across GPUs both are set at once
                with torch.cuda.stream(stage_stream), torch.cuda.stream(stream):
                    plan = self._plan_for(remote, rows)  # made on the stage stream, ahead of every scatter
                    stream.wait_event(ready)
                    copy_across(target if rows.dim() == 3 else target[None], rows if rows.dim() == 3 else rows[None],
                                plan, pool_stream)
            done = torch.cuda.Event()
            done.record(pool_stream)
            rows.record_stream(stream)  # the allocator must not hand its memory out before the copy read it
            self._last_copy = done
        except RuntimeError as e:  # the mapping or the device failed: this pairing cannot be trusted
            self._conn.break_(KVTransferError("peer_failed", f"copying room {self.room}'s rows into decode KV "
                                                             f"endpoint {self._conn.endpoint}'s pool failed: {e}"))
            return False
        return self._counted(rows)

    def _plan_for(self, remote: torch.Tensor, rows: torch.Tensor) -> PagePlan:
        # Once per room, at its first layer (every layer has the granted count, checked above): page_runs is a
        # Python loop over the pages, too slow to repeat for every layer on the writer thread.
        if self._plan is None:
            self._plan = plan_pages(self._dst_pages, rows.shape[-2], self.layout.page_size, remote.device)
        return self._plan

    def _counted(self, rows: torch.Tensor) -> bool:
        self._bytes += rows.numel() * rows.element_size()
        return True

    def _drain(self) -> None:
        """Wait (writer thread) until every copy of the room queued so far has completed."""
        if self._last_copy is not None:
            self._last_copy.synchronize()


class CudaIpcKVSender(TcpKVSender):
    """See `KVSender`. `ipc`: the GPU facts and calls (`IpcBackend`; the CPU tests pass fakes). `begin` needs
    `dst_pages` on a cuda_ipc pairing."""

    transport = IPC

    def __init__(self, layout: KVLayout, connect_timeout_s: float = 5.0, timeout_s: float = 300.0,
                 token: Optional[str] = None, checksum: bool = True, device: torch.device | str | None = None,
                 ipc: Optional[IpcBackend] = None):
        super().__init__(layout, connect_timeout_s, timeout_s, token, checksum, device)
        self._ipc = ipc or IpcBackend()
        self._facts = self._ipc.local_facts(self.device)
        self._tcp_only: dict[str, str] = {}  # endpoint -> why mapping its pool failed (auto: tcp from then on)

    def _start(self, conn, room, num_layers, dst_pages):
        handle = super()._start(conn, room, num_layers, dst_pages)
        if isinstance(handle, IpcSendHandle):
            handle._conn.put(handle, BEGIN, {"num_layers": num_layers, "pages": handle._dst_pages})
        return handle

    def _new_handle(self, conn, room, num_layers, dst_pages):
        if not isinstance(conn, _IpcConnection):
            return super()._new_handle(conn, room, num_layers, dst_pages)
        if dst_pages is None:
            raise ValueError("the cuda_ipc KV transport writes into the decode worker's pages: begin() needs "
                             "dst_pages")
        try:
            return IpcSendHandle(conn, room, num_layers, self.layout, self.timeout_s, dst_pages)
        except ValueError as e:  # pages from the peer that do not fit its own pool
            raise KVTransferError("protocol", f"room {room}: {e}") from None

    def _hello_fields(self, endpoint: str) -> dict[str, Any]:
        return {"transport": TCP if endpoint in self._tcp_only else self.transport,
                "ipc_facts": self._facts.to_dict()}

    def _connect(self, endpoint: str) -> _Connection:
        try:
            return super()._connect(endpoint)
        except _MapFailed as e:
            # auto: this pool cannot be mapped from here (another container, a driver refusal): tcp with it
            logger.warning("KV pair with decode %s: cuda_ipc offered but mapping its pool failed (%s); pairing over "
                           "tcp", endpoint, e.message)
            self._tcp_only[endpoint] = e.message
            return super()._connect(endpoint)

    def _open(self, endpoint: str, sock: socket.socket, hello_ok: dict[str, Any]) -> _Connection:
        mode, why = hello_ok.get("transport", TCP), hello_ok.get("reason", "the decode worker chose it")
        if mode == TCP and self.transport == AUTO:
            logger.info("KV pair with decode %s: over tcp (%s)", endpoint, why)
            return super()._open(endpoint, sock, hello_ok)
        if mode != IPC:
            raise ProtocolError(f"HELLO_OK chose transport {mode!r}; this sender asked for {self.transport}")
        try:
            check_export(hello_ok.get("ipc"), self.layout)
            remote = self._ipc.open(hello_ok["ipc"], self.layout.torch_dtype)
        except (RuntimeError, ValueError, TypeError) as e:  # TypeError: torch refused the fields' types
            message = f"decode KV endpoint {endpoint}'s pool cannot be mapped here: {e}"
            if self.transport == AUTO:
                raise _MapFailed(message) from None
            raise KVTransferError("unreachable", message) from None
        logger.info("KV pair with decode %s: over cuda_ipc (%s), its pool %s mapped on %s", endpoint, why,
                    tuple(remote.shape), remote.device)
        return _IpcConnection(endpoint, sock, remote, self.device, self.checksum)


class AutoKVSender(CudaIpcKVSender):
    """"auto": cuda_ipc where the decode worker offers it and its pool maps here, tcp otherwise (logged)."""

    transport = AUTO


class _MapFailed(KVTransferError):
    def __init__(self, message: str):
        super().__init__("unreachable", message)
