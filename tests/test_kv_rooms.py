"""The decode worker's view of KV transfers: requests by request_id, rooms inside kv_transfer."""

import pytest
import torch

from pdserve.common.values import KVLayout
from pdserve.kv_transfer import KVTransferError, RequestReceiver


class RecordingReceiver:
    """A KVReceiver stand-in that records what the wrapper asks and lets the test fire room callbacks."""

    def __init__(self, layout, on_layer, on_done, on_failed, cancel_drops=True, **options):
        self.on_layer, self.on_done, self.on_failed = on_layer, on_done, on_failed
        self.options, self.cancel_drops = options, cancel_drops
        self.expected: dict[int, int] = {}  # room -> num_tokens

    endpoint = "127.0.0.1:1"
    num_pending = 0

    def expect(self, room, num_tokens, dst_pages, num_layers):
        if num_tokens > 100:
            raise ValueError("too many tokens")
        self.expected[room] = num_tokens

    def cancel(self, room):
        return self.cancel_drops

    def close(self):
        pass


LAYOUT = KVLayout("fp", page_size=4, num_kv_layers=2, kv_dim=8, dtype="float32")


def make(cancel_drops=True):
    events = []
    rr = RequestReceiver(RecordingReceiver, LAYOUT, on_layer=lambda *a: events.append(("layer", a[0], a[1])),
                         on_done=lambda rid, aux: events.append(("done", rid, aux)),
                         on_failed=lambda rid, err: events.append(("failed", rid, err.kind)), cancel_drops=cancel_drops,
                         host="h")
    return rr, rr.receiver, events


def test_callbacks_arrive_by_request_id_and_rooms_are_never_reused():
    rr, inner, events = make()
    assert inner.options == {"host": "h"}
    room_a = rr.expect("a", 5, [0, 1], 2)
    room_b = rr.expect("b", 3, [2], 2)
    assert room_a != room_b and set(inner.expected) == {room_a, room_b}
    inner.on_layer(room_a, 0, torch.arange(5), None)
    inner.on_done(room_a, {"first_token_id": 1})
    inner.on_failed(room_b, KVTransferError("timeout", "late"))
    inner.on_layer(room_a, 1, torch.arange(5), None)  # after its last callback: dropped
    assert events == [("layer", "a", 0), ("done", "a", {"first_token_id": 1}), ("failed", "b", "timeout")]
    assert rr.expect("a", 5, [0, 1], 2) not in (room_a, room_b)  # the id is free again; the room is new


def test_one_transfer_per_request_and_a_refused_expect_leaves_nothing_behind():
    rr, inner, _ = make()
    rr.expect("a", 5, [0, 1], 2)
    with pytest.raises(ValueError, match="already has a KV transfer"):
        rr.expect("a", 5, [0, 1], 2)
    with pytest.raises(ValueError, match="too many tokens"):
        rr.expect("big", 1000, [0], 2)
    rr.expect("big", 10, [0, 1, 2], 2)  # the failed expect did not keep the id


def test_cancel_that_drops_silences_the_room_and_one_that_does_not_still_reports():
    rr, inner, events = make(cancel_drops=True)
    room = rr.expect("a", 5, [0, 1], 2)
    assert rr.cancel("a") is True and rr.cancel("unknown") is False
    inner.on_failed(room, KVTransferError("aborted", "x"))
    assert events == []

    rr, inner, events = make(cancel_drops=False)
    room = rr.expect("a", 5, [0, 1], 2)
    assert rr.cancel("a") is False  # the transport still writes: its last word must reach the worker
    inner.on_failed(room, KVTransferError("aborted", "x"))
    assert events == [("failed", "a", "aborted")]
