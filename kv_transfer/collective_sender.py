"""Prefill side of the collective KV transports: the TCP sender's control connection (HELLO, AUX, ABORT,
ROOM_DONE/ROOM_FAILED, deadlines) plus one process group per decode endpoint that carries the rows.

Per layer, or per run of layers, the rows are gathered into one contiguous block on the caller's stream and an event
is recorded after the gather (NCCL); the connection's writer thread then writes the LAYER announcement (the layers and
the token count, so the block's size) and right after it posts the block's one send on the pair's stream behind that
event. One thread does both, in queue order, so the op streams of interleaved rooms match the announcements the
decode worker reads, in the same order.
"""

from __future__ import annotations

import socket
from typing import Any, Sequence

import torch

from .base import KVLayout, KVTransferError, TransferState, gather_layers, gather_rows
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
    """See `SendHandle`. Each `send_rows` (one layer) or `send_layers` (a run of layers: layer by layer as the
    forward writes them, or the whole room at once) is one gather into a contiguous block and one send of it; the
    decode worker receives the block whole and scatters it into the reserved pages (`pages.py`)."""

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

    def send_layers(self, first_layer: int, source: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        layers = self._check_layers(first_layer, source, slots)
        if self.status.state != TransferState.FAILED:
            self._queue_rows(layers, gather_layers(source, slots))

    def _queue_layer(self, layer: int, source: torch.Tensor, slots: torch.Tensor | None) -> None:
        self._queue_rows([layer], gather_rows(source, slots, source.device))

    def _queue_rows(self, layers: list[int], rows: torch.Tensor) -> None:
        """Announce `layers` and send `rows` ((num_tokens, kv_dim) for one layer, (len(layers), num_tokens, kv_dim)
        for a run), a block this handle owns, as one op."""
        # NOTE: gathered on the caller's stream, so the caller may overwrite or free its source right away; the
        # event after the gather is what the send waits for, so the forward's next layers are not held up.
        ready = self._conn.pair.ready_event()
        n = rows.shape[-2]
        self._bytes += rows.numel() * rows.element_size()
        header = {"layer": layers[0]} if len(layers) == 1 else {"layers": layers}
        self._conn.put(self, LAYER, {**header, "num_tokens": n},
                       post=lambda: self._conn.pair.post([rows], send=True, after=ready))


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
