"""Prefill side of the collective KV transports: the pairing that joins the decode worker's process group (named in
its HELLO_OK) and the data plane that sends the rows over it, one op per LAYER announcement.

Per layer, or per run of layers (a large one cut into a few runs on a GPU, `pages.gather_chunks`), the rows are
gathered into one contiguous block on the caller's stream and an event is recorded after the gather (NCCL); the
connection's writer thread then writes the LAYER announcement (the layers and the token count, so the block's size)
and right after it posts the block's one send on the pair's stream behind that event. One thread does both, in queue order, so the op streams of interleaved rooms match the announcements the
decode worker reads, in the same order. The decode worker receives the block whole and scatters it into the reserved
pages (`pages.py`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import KVTransferError, gather_layers
from .collective_pair import BACKENDS, PREFILL_RANK, ProcessGroupPair
from .control_sender import RoomHandle
from .pages import Chunk, chunk_count, gather_chunks
from .plane import SendPairing, SendPlane
from .wire import LAYER, ProtocolError, parse_endpoint


class CollectivePairing(SendPairing):
    """The sender's `transport` names a backend of `BACKENDS` ("gloo", "nccl"); its `device` (where the rows live:
    the prefill pool's) is where the pair's warm-up exchange runs, at connect time."""

    connect_timeout_s = 10.0

    def __init__(self, sender):
        super().__init__(sender)
        self.backend = BACKENDS[sender.transport]
        if sender.device.type != self.backend.device_type:
            raise ValueError(f"the {sender.transport} KV sender moves {self.backend.device_type} tensors, not "
                             f"{sender.device.type} ones")

    def open(self, endpoint: str, sock: Any, hello_ok: dict[str, Any]) -> SendPlane:
        store, group = hello_ok.get("store"), hello_ok.get("group")
        if not (isinstance(store, str) and isinstance(group, str) and group):
            raise ProtocolError(f"HELLO_OK without the process group's store and name: {hello_ok!r}")
        s = self.sender
        try:
            pair = ProcessGroupPair.connect(
                self.backend, parse_endpoint(store), group, PREFILL_RANK, local_host=sock.getsockname()[0],
                device=s.device, connect_timeout_s=s.connect_timeout_s, op_timeout_s=s.timeout_s,
                name=f"prefill->{endpoint}")
        except (RuntimeError, ValueError) as e:  # torch.distributed's errors are RuntimeErrors
            raise KVTransferError("unreachable", f"could not set up the {s.transport} process group with decode "
                                                 f"KV endpoint {endpoint}: {e}") from None
        return CollectiveSendPlane(pair)


class CollectiveSendPlane(SendPlane):
    """The pair's process group; breaking the control connection tears it down, and its failure breaks the
    connection. Each `send_rows` (one layer) or `send_layers` (a run of layers: layer by layer as the forward writes
    them, or the whole room at once) is one gather into a contiguous block and one send of it."""

    writes_pages = True

    def __init__(self, pair: ProcessGroupPair):
        self.pair, self.name, self.device = pair, pair.backend.name, pair.device
        pair.on_broken = self._link_failed

    def send(self, handle: RoomHandle, layers: list[int], source: torch.Tensor,
             slots: Optional[torch.Tensor]) -> None:
        # NOTE: gathered on the caller's stream, so the caller may overwrite or free its source right away; the
        # event after the gather is what the send waits for, so the forward's next layers are not held up. A large
        # run of layers (a whole prompt at once) goes as a few ops of runs of layers, each announced and sent on its
        # own: one run's gather, its crossing and the decode worker's scatter of the run before it overlap.
        n = handle.num_tokens
        if source.dim() == 2 or self.device.type != "cuda":
            runs = [Chunk(0, gather_layers(source, slots), self.pair.ready_event())]
        else:
            runs = gather_chunks(source, slots, chunk_count(source.shape[0] * n * source.shape[-1]
                                                            * source.element_size()))
        for run in runs:
            rows, ready = run.rows, run.ready  # (num_tokens, kv_dim) for one layer, else (layers, num_tokens, kv_dim)
            handle.bytes_sent += rows.numel() * rows.element_size()
            part = layers[run.first:run.first + (rows.shape[0] if rows.dim() == 3 else 1)]
            header = {"layer": part[0]} if len(part) == 1 else {"layers": part}
            self.conn.put(handle, LAYER, {**header, "num_tokens": n},
                          post=lambda rows=rows, ready=ready: self.pair.post([rows], send=True, after=ready))

    def broken(self, error: KVTransferError) -> None:
        self.pair.close(error.message)

    def _link_failed(self, reason: str) -> None:  # the pair's reaper thread, an op failed
        if self.conn is not None:
            self.conn.break_(KVTransferError("peer_failed", f"the {self.name} link to decode KV endpoint "
                                                            f"{self.conn.endpoint} failed: {reason}"))
