"""The TCP KV transport ("tcp"): pure CPU and sockets, works between processes and machines without GPUs.

Its data plane rides on the control connection itself: each LAYER frame carries one layer's rows (`wire.py`), which
the decode receiver writes into the room's reserved pages on the connection's thread.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import TRANSPORTS, Transport, TransferState, gather_rows
from .control_receiver import KVReceiverChannel, Peer, Room, _is_int
from .control_sender import KVSenderChannel, RoomHandle
from .plane import ReceivePlane, SendPairing, SendPlane
from .wire import LAYER, ProtocolError, tensor_bytes


class TcpSendPlane(SendPlane):
    """Each layer's rows gathered to host memory and sent in its own LAYER frame."""

    name = "tcp"
    _copy_stream = None  # device-to-host copies of rows on a CUDA pool (made for the first such rows)

    def send(self, handle: RoomHandle, layers: list[int], source: torch.Tensor,
             slots: Optional[torch.Tensor]) -> None:
        for i, layer in enumerate(layers):
            self._send_layer(handle, layer, source if source.dim() == 2 else source[i], slots)

    def _send_layer(self, handle: RoomHandle, layer: int, source: torch.Tensor, slots: Optional[torch.Tensor]) -> None:
        header = {"layer": layer, "num_tokens": handle.num_tokens}
        if source.device.type != "cuda":
            # NOTE: gathered here, so the caller may overwrite or free the source pages as soon as this returns.
            self.conn.put(handle, LAYER, header, tensor_bytes(gather_rows(source, slots, "cpu")))
            return
        # Gathered on the caller's stream (ordered after the forward that wrote the layer and before anything
        # that overwrites it), then copied to pinned host memory on a side stream without waiting for it.
        rows = gather_rows(source, slots, source.device)  # (num_tokens, kv_dim)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(source.device)
        copy_stream = self._copy_stream
        copy_stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(copy_stream):
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(copy_stream)
        rows.record_stream(copy_stream)  # the allocator must not hand its memory out before the copy read it

        def build() -> list[bytes | memoryview]:
            # The writer thread waits for the copy, then checksums and encodes: the caller (the prefill engine's
            # thread) never waits for the device, so the forward's next layers are queued at once.
            ready.synchronize()
            return self.conn.frame(handle, LAYER, header, tensor_bytes(host))

        self.conn.queue.put((handle, LAYER, build, None))


class TcpPairing(SendPairing):
    def open(self, endpoint: str, sock: Any, hello_ok: dict[str, Any]) -> SendPlane:
        return TcpSendPlane()


class TcpReceivePlane(ReceivePlane):
    """The rows of each LAYER frame into the room's reserved slots of the pool (or to on_layer without a pool)."""

    name = "tcp"
    _copy_stream = None  # a CUDA pool's rows are copied on a stream of their own, beside the decode steps

    def on_frame(self, peer: Peer, kind: str, room: int, header: dict[str, Any], payload: torch.Tensor) -> None:
        ch = self.channel
        with ch.lock:
            r = ch.live_room_locked(peer, kind, room)
            if r is None:
                return
            r.conn = peer
            parsed = ch.read_locked(r, kind, header, payload, self._parse_layer)
            if parsed is None:
                return
            layer, values = parsed
            r.status.advance(TransferState.TRANSFERRING)
            if ch.kv is not None:
                self._write_rows(r, layer, values)
                values = None
            ch.land_locked(r, [layer], values)

    def _write_rows(self, r: Room, layer: int, values: torch.Tensor) -> None:
        """The layer's rows into the room's reserved slots of the pool.

        NOTE: synchronous (the copy stream is waited for here, with the GIL released), so once cancel() returns no
        write of the room can still land in pages the decode worker then frees and hands to another request."""
        pool = self.channel.kv
        if pool.device.type != "cuda":
            if r.pool_slots is None:
                r.pool_slots = r.dst_slots.to(pool.device)
            pool[layer].index_copy_(0, r.pool_slots, values.to(pool.dtype))
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(pool.device)
        with torch.cuda.stream(self._copy_stream):
            if r.pool_slots is None:
                r.pool_slots = r.dst_slots.to(pool.device, non_blocking=True)
            pool[layer].index_copy_(0, r.pool_slots, values.to(pool.device, pool.dtype, non_blocking=True))
        self._copy_stream.synchronize()

    def _parse_layer(self, r: Room, header: dict[str, Any], payload: torch.Tensor) -> tuple[int, torch.Tensor]:
        layout = self.channel.layout
        layer, n = header["layer"], header["num_tokens"]
        if not (_is_int(layer) and 0 <= layer < r.num_layers):
            raise ValueError(f"layer {layer!r} is outside the room's {r.num_layers} layers")
        if layer in r.layers:
            raise ValueError(f"layer {layer} arrived twice")
        if not _is_int(n) or n != r.num_tokens:
            raise ValueError(f"prefill sent {n} tokens, decode expected {r.num_tokens}")
        itemsize = layout.torch_dtype.itemsize
        if payload.numel() != n * layout.kv_dim * itemsize:
            raise ValueError(f"payload of {payload.numel()} bytes is not {n} x {layout.kv_dim} x {itemsize}")
        return layer, payload.view(layout.torch_dtype).view(n, layout.kv_dim)  # (num_tokens, kv_dim)


class TcpKVSender(KVSenderChannel):
    transport, pairing_cls = "tcp", TcpPairing


class TcpKVReceiver(KVReceiverChannel):
    transport, plane_cls = "tcp", TcpReceivePlane


TRANSPORTS.register("tcp")(Transport(sender=TcpKVSender, receiver=TcpKVReceiver))

__all__ = ["TcpKVReceiver", "TcpKVSender", "TcpPairing", "TcpReceivePlane", "TcpSendPlane"]
