"""Decode side, as the decode worker sees it: KV for *requests*. Rooms stay inside kv_transfer.

A room is a transfer's id on the wire (the sender names it in every frame); the decode worker knows a request only
by its request_id. `RequestReceiver` gives each expected request a fresh room, builds the transport's receiver with
room callbacks, and hands the worker the same callbacks keyed by request_id:

    receiver = RequestReceiver(TRANSPORTS.get(name).receiver, layout, on_layer=..., on_done=..., on_failed=..., **options)
    room = receiver.expect(request_id, num_tokens, dst_pages, num_layers)   # the room goes to prefill via the router
    receiver.cancel(request_id)
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from .base import KVReceiver, KVTransferError

# (request_id, layer, dst_slots, values) / (request_id, aux) / (request_id, error): as KVReceiver's, by request.
OnRequestLayer = Callable[[str, int, torch.Tensor, Optional[torch.Tensor]], None]
OnRequestDone = Callable[[str, dict[str, Any]], None]
OnRequestFailed = Callable[[str, KVTransferError], None]


class RequestReceiver:
    """Wraps one `KVReceiver`; same callback order and threading contract (see KVReceiver), keyed by request_id."""

    def __init__(self, receiver_cls: type[KVReceiver], layout, on_layer: OnRequestLayer, on_done: OnRequestDone,
                 on_failed: OnRequestFailed, **options):
        self._on_layer, self._on_done, self._on_failed = on_layer, on_done, on_failed
        self._lock = threading.Lock()
        self._next_room = itertools.count(1)  # never reused in a process: a late frame cannot hit a new request
        self._request_of: dict[int, str] = {}  # room -> request id, until the room's last callback
        self._room_of: dict[str, int] = {}
        self.receiver = receiver_cls(layout, on_layer=self._layer, on_done=self._done, on_failed=self._failed,
                                     **options)

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint

    @property
    def num_pending(self) -> int:
        return self.receiver.num_pending

    def expect(self, request_id: str, num_tokens: int, dst_pages: Sequence[int], num_layers: int) -> int:
        """Register the request's transfer; returns its room (for the sender). ValueError if the request already
        has one in flight here."""
        with self._lock:
            if request_id in self._room_of:
                raise ValueError(f"request_id {request_id!r} already has a KV transfer on this decode worker")
            room = next(self._next_room)
            self._request_of[room], self._room_of[request_id] = request_id, room
        try:
            self.receiver.expect(room, num_tokens, dst_pages, num_layers)
        except BaseException:
            self._forget(room)
            raise
        return room

    def cancel(self, request_id: str) -> bool:
        """As KVReceiver.cancel: True = dropped, no callback follows; False = on_failed (or on_done) still comes."""
        with self._lock:
            room = self._room_of.get(request_id)
        if room is None:
            return False
        dropped = self.receiver.cancel(room)
        if dropped:
            self._forget(room)
        return dropped

    def close(self) -> None:
        self.receiver.close()

    # ---- the transport's room callbacks (its threads) -------------------------------------------------------------
    def _layer(self, room: int, layer: int, slots: torch.Tensor, values: Optional[torch.Tensor]) -> None:
        with self._lock:
            request_id = self._request_of.get(room)
        if request_id is not None:
            self._on_layer(request_id, layer, slots, values)

    def _done(self, room: int, aux: dict[str, Any]) -> None:
        request_id = self._forget(room)
        if request_id is not None:
            self._on_done(request_id, aux)

    def _failed(self, room: int, error: KVTransferError) -> None:
        request_id = self._forget(room)
        if request_id is not None:
            self._on_failed(request_id, error)

    def _forget(self, room: int) -> Optional[str]:
        with self._lock:
            request_id = self._request_of.pop(room, None)
            if request_id is not None and self._room_of.get(request_id) == room:
                del self._room_of[request_id]
            return request_id
