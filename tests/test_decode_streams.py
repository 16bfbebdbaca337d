"""The decode worker's StreamHub without gRPC or a model: one message per engine step for all the requests of a
DecodeStream call, outputs before the attach kept, a slow reader's steps merged per request, and who is told what
when a request finishes, fails, is cancelled or loses its call."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.decode_service.streams import Connection, StreamHub
from pdserve.engine import RequestOutput
from pdserve.kv_transfer import KVTransferError
from pdserve.serving.metrics import Metrics
from pdserve.v1 import generate_pb2 as gen_pb


def out(rid: str, tokens: list[int], finished: bool = False, so_far: int = 1) -> RequestOutput:
    return RequestOutput(rid, tokens, "".join(f"<{t}>" for t in tokens), finished, list(range(so_far)),
                         "length" if finished else None, prompt_tokens=4, cached_tokens=0)


class Hub:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool]] = []
        self.hub = StreamHub(Metrics.create("decode"), lambda rid: self.events.append(("attached", rid, False)),
                             lambda rid, finished: self.events.append(("detached", rid, finished)))


def run(coro):
    return asyncio.run(coro)


def test_one_message_per_step_for_every_request_of_a_call():
    async def main():
        h = Hub()
        conn = Connection()
        for rid in ("a", "b", "c"):
            h.hub.open(rid)
            assert h.hub.attach(conn, rid)
        h.hub.deliver([("a", out("a", [1])), ("b", out("b", [2])), ("c", out("c", [3]))])  # one step
        batch = await conn.next_batch()
        msg = h.hub.message(batch)
        assert [(u.request_id, list(u.token_ids), u.text) for u in msg.updates] == [
            ("a", [1], "<1>"), ("b", [2], "<2>"), ("c", [3], "<3>")]
        assert conn.batches.empty()
    run(main())


def test_outputs_before_the_attach_are_kept_and_a_slow_readers_steps_merge_per_request():
    async def main():
        h = Hub()
        conn = Connection()
        h.hub.open("a")
        h.hub.open("b")
        h.hub.deliver([("a", out("a", [7]))])  # the first token, ready before the router's attach arrived
        assert h.hub.attach(conn, "a") and h.hub.attach(conn, "b")
        h.hub.deliver([("a", out("a", [8])), ("b", out("b", [1]))])
        h.hub.deliver([("a", out("a", [9], finished=True, so_far=3)), ("b", out("b", [2]))])
        msg = h.hub.message(await conn.next_batch())  # the reader was busy: three batches in one message
        a, b = msg.updates
        assert (a.request_id, list(a.token_ids), a.text) == ("a", [7, 8, 9], "<7><8><9>")
        assert a.finish_reason == gen_pb.FINISH_REASON_LENGTH and a.usage.completion_tokens == 3
        assert (b.request_id, list(b.token_ids), b.finish_reason) == ("b", [1, 2], gen_pb.FINISH_REASON_UNSPECIFIED)
        assert "a" not in h.hub and "b" in h.hub  # a finished request leaves the hub with its last update
        assert ("detached", "a", True) in h.events
    run(main())


def test_a_failure_ends_only_its_request_with_its_status():
    async def main():
        h = Hub()
        conn = Connection()
        for rid in ("ok", "bad"):
            h.hub.open(rid)
            h.hub.attach(conn, rid)
        h.hub.deliver([("ok", out("ok", [1])), ("bad", KVTransferError("timeout", "room 3: no KV within 1 s"))])
        ok, bad = h.hub.message(await conn.next_batch()).updates
        assert not ok.HasField("failure") and list(ok.token_ids) == [1]
        assert bad.failure.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert "KV transfer failed" in bad.failure.message
        assert "bad" not in h.hub and "ok" in h.hub
    run(main())


def test_unknown_or_twice_attached_ids_get_not_found_and_touch_nothing():
    async def main():
        h = Hub()
        first, second = Connection(), Connection()
        h.hub.open("a")
        assert h.hub.attach(first, "a")
        assert not h.hub.attach(second, "a") and not h.hub.attach(second, "ghost")
        refusals = h.hub.message(await second.next_batch()).updates
        assert [(u.request_id, u.failure.code) for u in refusals] == [
            ("a", grpc.StatusCode.NOT_FOUND.value[0]), ("ghost", grpc.StatusCode.NOT_FOUND.value[0])]
        h.hub.deliver([("a", out("a", [5]))])  # still on its first call
        assert [list(u.token_ids) for u in h.hub.message(await first.next_batch()).updates] == [[5]]
    run(main())


def test_cancel_and_a_closed_call_detach_unfinished_requests():
    async def main():
        h = Hub()
        conn, other = Connection(), Connection()
        for rid in ("a", "b", "c"):
            h.hub.open(rid)
        h.hub.attach(conn, "a")
        h.hub.attach(conn, "b")
        h.hub.attach(other, "c")
        h.hub.cancel(other, "a")  # not its request: ignored
        assert "a" in h.hub
        h.hub.cancel(conn, "a")
        h.hub.close(conn)
        assert "a" not in h.hub and "b" not in h.hub and "c" in h.hub
        assert [e for e in h.events if e[0] == "detached"] == [("detached", "a", False), ("detached", "b", False)]
        h.hub.deliver([("a", out("a", [1])), ("c", out("c", [2]))])  # outputs of a cancelled request are dropped
        assert [u.request_id for u in h.hub.message(await other.next_batch()).updates] == ["c"]
    run(main())
