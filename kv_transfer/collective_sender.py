"""Prefill side of the collective KV transports: the TCP sender's control connection (HELLO, AUX, ABORT,
ROOM_DONE/ROOM_FAILED, deadlines) plus one process group per decode endpoint that carries the rows.

Per layer, `send_rows` gathers the rows on the caller's stream and records an event after the copy (NCCL); the
connection's writer thread then writes the LAYER announcement, which lists how many rows each op carries, and
right after it posts those sends on the pair's stream behind that event. One thread does both, in queue order,
so the op streams of interleaved rooms match the announcements the decode worker reads, in the same order.
"""

from __future__ import annotations

import socket
from typing import Any, Sequence

import torch

from .base import KVLayout, KVTransferError, gather_rows, page_runs
from .collective_pair import BACKENDS, PREFILL_RANK, ProcessGroupPair
from .tcp_sender import TcpKVSender, TcpSendHandle, _Connection
from .wire import LAYER, ProtocolError, parse_endpoint


class _PairedConnection(_Connection):
    """A control connection and the process group it set up; breaking one tears down the other."""

    def __init__(self, endpoint: str, sock: socket.socket, pair: ProcessGroupPair, checksum: bool):
        self.pair, self.transport = pair, pair.backend.name
        super().__init__(endpoint, sock, checksum)
        pair.on_broken = lambda reason: self.break_(KVTransferError(
            "peer_failed", f"the {pair.backend.name} link to decode KV endpoint {endpoint} failed: {reason}"))

    def break_(self, error: KVTransferError) -> None:
        super().break_(error)
        self.pair.close(self.broken.message)  # the first error is the one worth logging


class CollectiveSendHandle(TcpSendHandle):
    """See `SendHandle`. The rows go over the pair's process group, split by the destination page runs."""

    def __init__(self, conn: _PairedConnection, room: int, num_layers: int, layout: KVLayout, timeout_s: float,
                 dst_pages: Sequence[int]):
        super().__init__(conn, room, num_layers, layout, timeout_s)
        self._dst_pages = list(dst_pages)

    def _check_layer(self, layer: int, source: torch.Tensor, slots: torch.Tensor | None) -> int:
        n = super()._check_layer(layer, source, slots)
        if source.device != self._conn.pair.device:
            raise ValueError(f"room {self.room}: values are on {source.device}, this {self._conn.pair.backend.name} "
                             f"sender moves rows on {self._conn.pair.device}")
        need = -(-n // self.layout.page_size)
        if len(self._dst_pages) < need:
            raise ValueError(f"room {self.room}: {n} tokens need {need} destination pages, "
                             f"begin() was given {len(self._dst_pages)}")
        return n

    def _queue_layer(self, layer: int, source: torch.Tensor, slots: torch.Tensor | None) -> None:
        # NOTE: gathered on the caller's stream, so the caller may overwrite or free its source right away; the
        # event after the gather is what the sends wait for, so the forward's next layers are not held up.
        rows = gather_rows(source, slots, source.device)  # (num_tokens, kv_dim)
        n = rows.shape[0]
        ready = self._conn.pair.ready_event()
        runs = page_runs(range(-(-n // self.layout.page_size)), self._dst_pages, n, self.layout.page_size)
        chunks = [rows[src:src + count] for src, _, count in runs]  # contiguous views, token order
        self._bytes += rows.numel() * rows.element_size()
        self._conn.put(self, LAYER, {"layer": layer, "num_tokens": n, "runs": [count for _, _, count in runs]},
                       post=lambda: self._conn.pair.post(chunks, send=True, after=ready))


class CollectiveKVSender(TcpKVSender):
    """See `KVSender`; a subclass sets `transport` to a backend of `BACKENDS` ("gloo", "nccl"). `device`: where
    the rows live (the prefill pool's device); the pair's warm-up exchange runs there at connect time. `begin`
    needs `dst_pages`."""

    def __init__(self, layout: KVLayout, connect_timeout_s: float = 10.0, timeout_s: float = 300.0,
                 token: str | None = None, checksum: bool = True, device: torch.device | str | None = None):
        super().__init__(layout, connect_timeout_s, timeout_s, token, checksum, device)
        self.backend = BACKENDS[self.transport]
        if self.device.type != self.backend.device_type:
            raise ValueError(f"the {self.transport} KV sender moves {self.backend.device_type} tensors, not "
                             f"{self.device.type} ones")

    def _new_handle(self, conn, room, num_layers, dst_pages):
        if dst_pages is None:
            raise ValueError(f"the {self.transport} KV transport writes into the decode worker's pages: begin() "
                             "needs dst_pages")
        return CollectiveSendHandle(conn, room, num_layers, self.layout, self.timeout_s, dst_pages)

    def _open(self, endpoint: str, sock: socket.socket, hello_ok: dict[str, Any]) -> _PairedConnection:
        store, group = hello_ok.get("store"), hello_ok.get("group")
        if not (isinstance(store, str) and isinstance(group, str) and group):
            raise ProtocolError(f"HELLO_OK without the process group's store and name: {hello_ok!r}")
        try:
            pair = ProcessGroupPair.connect(
                self.backend, parse_endpoint(store), group, PREFILL_RANK, local_host=sock.getsockname()[0],
                device=self.device, connect_timeout_s=self.connect_timeout_s, op_timeout_s=self.timeout_s,
                name=f"prefill->{endpoint}")
        except (RuntimeError, ValueError) as e:  # torch.distributed's errors are RuntimeErrors
            raise KVTransferError("unreachable", f"could not set up the {self.transport} process group with decode "
                                                 f"KV endpoint {endpoint}: {e}") from None
        return _PairedConnection(endpoint, sock, pair, self.checksum)
