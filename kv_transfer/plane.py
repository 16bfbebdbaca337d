"""A KV transport is the control channel every transport shares plus a data plane of its own.

The control channel (`control_sender.py`, `control_receiver.py`) owns what does not depend on how the rows travel:
the connection and its handshake (HELLO with the internal token and the layout, one deadline, bounded size and
pending handshakes), rooms, their deadlines, aborts, the AUX record, ROOM_DONE / ROOM_FAILED, and failed rooms whose
pages may still be written ("draining"). The handshake picks each pairing's data plane: tcp (the rows ride in the
LAYER frames, `tcp.py`), cuda_ipc (the sender copies them into the mapped decode pool, LAYER announces them,
`cuda_ipc_*.py`), nccl and gloo (one op of the pair's process group per LAYER announcement, `collective_*.py`).
A plane calls its channel's methods and never stands in for them: the channel's locking is the channel's alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence

import torch

from .base import KVTransferError
from .wire import ABORT, LAYER

# NOTE: the channel's types (Connection, RoomHandle, KVSenderChannel; KVReceiverChannel, Peer, Room) are named in
# the annotations only: the channel imports this module.


class PairAgain(KVTransferError):
    """Raised by `SendPairing.open`: handshake once more (auto, when the decode pool it was offered cannot be mapped
    here: it asks for tcp the second time)."""

    def __init__(self, message: str):
        super().__init__("unreachable", message)


class SendPlane(ABC):
    """Prefill side of one pairing's data plane. The channel calls `open_room` and `send` on the caller's thread,
    `drain` on the connection's writer thread, `on_reply` on its reader thread, `failed` on whichever thread failed
    the room (after its handle left the connection)."""

    name: str  # what the rows travel over: the `transport` label of the transfer metrics and errors
    streams_layers = True  # see `SendHandle.streams_layers`
    writes_pages = False  # True: the rows go straight into the reserved pages, so begin() needs dst_pages
    device: Optional[torch.device] = None  # where the rows must be (None: anywhere)
    conn: Optional[Connection] = None  # the control connection, set before its threads start

    def open_room(self, handle: RoomHandle) -> None:
        """A room registered on the connection; raise KVTransferError to refuse it."""

    @abstractmethod
    def send(self, handle: RoomHandle, layers: list[int], source: torch.Tensor,
             slots: Optional[torch.Tensor]) -> None:
        """Queue the rows of `layers` (consecutive, checked by the handle): `source` is one layer of the pool
        `(num_slots, kv_dim)` for one layer, a run of them `(len(layers), num_slots, kv_dim)` otherwise (or the rows
        themselves without slots). Gathered into memory the plane owns before this returns."""

    def drain(self, handle: RoomHandle) -> None:
        """Before the room's AUX or ABORT goes out (writer thread): wait until its rows queued so far have landed."""

    def failed(self, handle: RoomHandle, local: bool) -> None:
        """The room failed; `local`: this side decided it (abort, deadline), so the decode worker is told."""
        if local:
            self.conn.put(handle, ABORT, {})

    def on_reply(self, header: dict[str, Any], handle: Optional[RoomHandle]) -> bool:
        """A reply other than ROOM_DONE / ROOM_FAILED; False: not one this plane knows (a protocol error)."""
        return False

    def broken(self, error: KVTransferError) -> None:
        """The connection broke: stop what the plane runs beside it (immediately, on the breaking thread)."""

    def ended(self) -> None:
        """Both threads of the connection are done: release what the plane holds."""


class SendPairing(ABC):
    """Prefill side of a transport's handshake, one per sender: what HELLO says, and the plane HELLO_OK leads to.
    Built as `cls(sender, **options)`."""

    connect_timeout_s = 5.0  # the sender's default

    def __init__(self, sender: KVSenderChannel):
        self.sender = sender

    def hello(self, endpoint: str) -> dict[str, Any]:
        """HELLO's fields beyond the version, the layout and the token."""
        return {"transport": self.sender.transport}

    @abstractmethod
    def open(self, endpoint: str, sock: Any, hello_ok: dict[str, Any]) -> SendPlane:
        """The pairing's plane over a handshaken socket. Raises KVTransferError, ProtocolError or OSError (the
        channel closes the socket) or `PairAgain`."""


class ReceivePlane(ABC):
    """Decode side of a transport's data plane, one per receiver, built as `cls(channel, **options)` before the
    receiver accepts. `on_frame` runs on a connection's thread without the channel's lock; every other call holds
    it except `paired`, `disconnected`, `teardown` and `close`."""

    name: str  # what the rows travel over (see SendPlane.name)
    frames: tuple[str, ...] = (LAYER,)  # the frames it takes besides AUX and ABORT
    # The sender writes the pages itself (cuda_ipc): a draining room's pages are free once its sender's ABORT came
    # (its writes completed) or its connection ended (a live sender stops writing, a dead one took them with it).
    released_by_abort = False

    def __init__(self, channel: KVReceiverChannel):
        self.channel = channel

    def pair(self, peer: Peer, hello: dict[str, Any]) -> str | tuple[ReceivePlane, dict[str, Any]]:
        """At HELLO (after the token and the layout): why this sender is refused, or the plane its connection uses
        and the fields of HELLO_OK."""
        return self.transport_problem(hello) or (self, {})

    def transport_problem(self, hello: dict[str, Any]) -> Optional[str]:
        transport, mine = hello.get("transport", "tcp"), self.channel.transport  # older senders spoke TCP
        if transport == mine or (transport == "auto" and mine == "tcp"):
            return None  # an "auto" sender pairs over tcp with a tcp receiver (HELLO_OK names no other transport)
        return f"KV transport mismatch: prefill {transport!r} vs decode {mine!r} (give both workers the same " \
               f"--kv-transport)"

    def paired(self, peer: Peer, hello_ok: dict[str, Any]) -> bool:
        """After HELLO_OK went out: set up what else the pairing needs; False drops the connection."""
        return True

    def expected(self, room: Room) -> None:
        """expect() registered the room (the caller's thread)."""

    @abstractmethod
    def on_frame(self, peer: Peer, kind: str, room: int, header: dict[str, Any], payload: torch.Tensor) -> None:
        """A frame of `frames` for `room`; raise ProtocolError for one that ends the connection."""

    def aux_layers(self, room: Room, header: dict[str, Any]) -> Optional[Sequence[int]]:
        """Before the room's AUX (`header`) is taken: the layers it completes (delivered to on_layer then), None when
        it failed the room instead (a bad `layers` announcement in it, on the planes that take one); raise
        ProtocolError if the room may not have its AUX yet."""
        return ()

    def drains(self, room: Room, notify: bool) -> bool:
        """The room failed (`notify`: its sender is yet to be told): True when its pages may still be written, so
        they are released only later (`KVReceiverChannel.release_locked`)."""
        return False

    def disconnected(self, peer: Peer) -> None:
        """The connection ended and its rooms were failed."""

    def teardown(self, peer: Peer, reason: str) -> None:
        """A room of this pairing stayed draining too long: end the pairing (on a thread of its own)."""
        peer.shutdown()

    def close(self) -> None:
        """The receiver closed; its connections ended."""
