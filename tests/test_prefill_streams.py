"""The router's prompts travel on one open PrefillStream call per prefill worker (prefill_service/prompt_calls.py and
router/prefill_streams.py): the worker's end without a model (answers batched, cancels, binds, drain, the call
ending), the router's end against a call that breaks, and a real stack whose routed requests all come on one
call, with a raw call's prompt, bind and cancel."""

from __future__ import annotations

import asyncio
import queue
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.router.prefill_streams import PrefillStreams
from pdserve.router.workers import Worker
from pdserve.sampling import SamplingParams
from pdserve.serving.grpc_shell import Drain, ServiceError
from pdserve.prefill_service.prompt_calls import PromptCall
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from stack import decode_updates, generate, scrape, wait_idle

UNAVAILABLE, ALREADY_EXISTS = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT


# ---- the worker's end, without a model or gRPC ---------------------------------------------------------------------
class FakeWorker:
    """prefill(): keeps the prompt's destination future, waits until the test releases the request id, then answers
    it as its first token (or raises what the test set)."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Future] = {}
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.destinations: dict[str, asyncio.Future] = {}
        self.drain = Drain()

    def gate(self, rid: str) -> asyncio.Future:
        return self.release.setdefault(rid, asyncio.get_running_loop().create_future())

    async def prefill(self, request: pb.PrefillRequest, destination: asyncio.Future) -> pb.PrefillResponse:
        rid = request.request_id
        self.started.append(rid)
        self.destinations[rid] = destination
        try:
            outcome = await self.gate(rid)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        if isinstance(outcome, BaseException):
            raise outcome
        return pb.PrefillResponse(first_token_id=outcome)

    def call(self) -> PromptCall:
        return PromptCall(self.prefill, self.drain)


class Requests:
    """The router's side of the call: messages the test puts, then (optionally) the router closing its side."""

    def __init__(self) -> None:
        self.q: asyncio.Queue = asyncio.Queue()

    def send(self, **fields) -> None:
        self.q.put_nowait(pb.PrefillStreamRequest(**fields))

    def close(self) -> None:
        self.q.put_nowait(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.PrefillStreamRequest:
        msg = await self.q.get()
        if msg is None:
            raise StopAsyncIteration
        return msg


def prompt(rid: str) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=rid, input_ids=[1, 2, 3])


def outcomes(msg: pb.PrefillStreamResponse) -> list[tuple[str, object]]:
    return [(a.request_id, a.response.first_token_id if a.HasField("response") else grpc.StatusCode(
        next(c for c in grpc.StatusCode if c.value[0] == a.failure.code))) for a in msg.answers]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_answers_that_finish_together_share_a_message_and_failures_carry_their_status():
    async def main():
        w, requests = FakeWorker(), Requests()
        responses = w.call().serve(requests)
        requests.send(prefill=[prompt("a"), prompt("b"), prompt("c")])
        first = asyncio.ensure_future(responses.__anext__())
        await settle()
        assert w.started == ["a", "b", "c"] and w.drain.in_flight == 3
        w.gate("a").set_result(7)
        w.gate("c").set_result(ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "cannot pair"))
        assert outcomes(await first) == [("a", 7), ("c", grpc.StatusCode.FAILED_PRECONDITION)]
        w.gate("b").set_exception(RuntimeError("a bug"))  # unexpected: INTERNAL, its text not sent
        msg = await responses.__anext__()
        assert outcomes(msg) == [("b", grpc.StatusCode.INTERNAL)] and "a bug" not in msg.answers[0].failure.message
        await settle()
        assert w.drain.in_flight == 0
        requests.close()
        with pytest.raises(StopAsyncIteration):  # closed, and nothing in flight: the call ends
            await responses.__anext__()
    asyncio.run(main())


def test_a_cancel_drops_its_prompt_without_an_answer_even_in_the_message_that_brought_it():
    async def main():
        w, requests = FakeWorker(), Requests()
        call = w.call()
        responses = call.serve(requests)
        nxt = asyncio.ensure_future(responses.__anext__())
        requests.send(prefill=[prompt("a"), prompt("b")])
        await settle()
        requests.send(prefill=[prompt("c")], cancel=["a", "c", "unknown"])  # c: cancelled before it ever ran
        await settle()
        assert w.cancelled == ["a"] and "c" not in w.started and set(call.jobs) == {"b"}
        assert w.drain.in_flight == 1
        w.gate("b").set_result(3)
        assert outcomes(await nxt) == [("b", 3)]
        await settle()
        assert w.drain.in_flight == 0
    asyncio.run(main())


def bind(rid: str, room: int) -> pb.BindRequest:
    return pb.BindRequest(request_id=rid, destination=pb.ReserveResponse(room=room))


def test_a_bind_reaches_its_prompt_and_a_refused_one_fails_its_prompt_with_that_status_and_stops_it():
    """A second bind is ALREADY_EXISTS and one without its destination INVALID_ARGUMENT, each failing its prompt; a
    bind in the prompt's own message reaches it; a bind for a prompt not in flight is dropped."""
    async def main():
        w, requests = FakeWorker(), Requests()
        responses = w.call().serve(requests)
        nxt = asyncio.ensure_future(responses.__anext__())
        requests.send(prefill=[prompt("ok"), prompt("twice"), prompt("bare")])
        await settle()  # all computing
        requests.send(prefill=[prompt("along")],
                      bind=[bind("ok", 1), bind("twice", 2), bind("twice", 3), pb.BindRequest(request_id="bare"),
                            bind("gone", 4), bind("along", 5)])
        msg = await nxt
        assert outcomes(msg) == [("twice", ALREADY_EXISTS), ("bare", INVALID_ARGUMENT)], msg
        assert "already has a KV destination" in msg.answers[0].failure.message
        assert "destination" in msg.answers[1].failure.message
        await settle()
        assert sorted(w.cancelled) == ["bare", "twice"] and "gone" not in w.started
        assert w.destinations["ok"].result().room == 1 and w.destinations["along"].result().room == 5
    asyncio.run(main())


def test_a_draining_worker_refuses_new_prompts_and_a_repeated_id_is_already_exists():
    async def main():
        w, requests = FakeWorker(), Requests()
        responses = w.call().serve(requests)
        requests.send(prefill=[prompt("a"), prompt("a")])
        assert outcomes(await responses.__anext__()) == [("a", ALREADY_EXISTS)]
        w.drain.draining = True
        requests.send(prefill=[prompt("late")])
        msg = await responses.__anext__()
        assert outcomes(msg) == [("late", UNAVAILABLE)] and "draining" in msg.answers[0].failure.message
        assert w.started == ["a"] and w.drain.in_flight == 1  # the prompt in flight goes on: a stop waits for it
        w.gate("a").set_result(1)
        assert outcomes(await responses.__anext__()) == [("a", 1)]
    asyncio.run(main())


def test_the_call_waits_for_its_prompts_after_the_router_closes_its_side_and_ending_it_drops_them():
    async def main():
        w, requests = FakeWorker(), Requests()
        responses = w.call().serve(requests)
        requests.send(prefill=[prompt("a")])
        requests.close()
        nxt = asyncio.ensure_future(responses.__anext__())
        await settle()
        assert not nxt.done()  # closed, but "a" is still in flight
        w.gate("a").set_result(5)
        assert outcomes(await nxt) == [("a", 5)]
        with pytest.raises(StopAsyncIteration):
            await responses.__anext__()

        w2, requests2 = FakeWorker(), Requests()
        responses2 = w2.call().serve(requests2)
        requests2.send(prefill=[prompt("x"), prompt("y")])
        nxt = asyncio.ensure_future(responses2.__anext__())
        await settle()
        nxt.cancel()  # gRPC cancels the handler: the router went away
        with pytest.raises(asyncio.CancelledError):
            await nxt
        await responses2.aclose()
        await settle()
        assert sorted(w2.cancelled) == ["x", "y"] and w2.drain.in_flight == 0
    asyncio.run(main())


# ---- the router's end, against a call that breaks -------------------------------------------------------------------
class BrokenCall:
    """A PrefillStream call whose worker answers one prompt, then the call fails (the worker process died)."""

    def __init__(self, commands) -> None:
        self.commands, self.sent, self.cancelled = commands, [], False
        self.go_on = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        first = await self.commands.__anext__()
        self.sent.append(first)
        yield pb.PrefillStreamResponse(answers=[pb.PrefillAnswer(request_id="a", response=pb.PrefillResponse(
            first_token_id=9))])
        await self.go_on.wait()
        self.sent.append(await self.commands.__anext__())
        raise grpc.aio.AioRpcError(UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "Socket closed")


class FakeStub:
    """A prefill worker's stub whose PrefillStream calls are BrokenCalls."""

    def __init__(self) -> None:
        self.calls: list = []

    def PrefillStream(self, commands, metadata=None):  # noqa: N802 (the stub's method name)
        self.calls.append(BrokenCall(commands))
        return self.calls[-1]


def test_every_prompt_on_a_call_that_breaks_fails_unavailable_and_the_next_prompt_opens_a_new_call():
    async def main():
        stub = FakeStub()
        worker = Worker("p:1", "prefill", channel=None, stub=stub, healthy=True)
        seen = []
        streams = PrefillStreams(metadata=(), seen=seen.append)
        call = streams.to(worker)
        a, b, c = (call.prefill(prompt(rid)) for rid in "abc")
        assert (await a).first_token_id == 9 and seen == [worker]
        call.bind(pb.BindRequest(request_id="b"))
        c.cancel()
        stub.calls[0].go_on.set()
        with pytest.raises(Exception) as failed:
            await b
        assert failed.value.code() == UNAVAILABLE and "Socket closed" in failed.value.details()
        sent = stub.calls[0].sent
        assert [r.request_id for r in sent[0].prefill] == ["a", "b", "c"]  # queued together: one message
        assert [r.request_id for r in sent[1].bind] == ["b"] and list(sent[1].cancel) == ["c"]
        assert stub.calls[0].cancelled and streams.calls == {}
        late = call.prefill(prompt("d"))  # on the broken call (a router still holding it): fails at once
        with pytest.raises(Exception) as failed:
            await late
        assert failed.value.code() == UNAVAILABLE
        assert streams.to(worker) is not call and len(stub.calls) == 2
        streams.close()
    asyncio.run(main())


# ---- through a real stack -------------------------------------------------------------------------------------------
def received(proc, rpc: str) -> float:
    found = re.findall(rf'^pdserve_prompts_received_total{{[^}}]*rpc="{rpc}"[^}}]*}} (\S+)$', scrape(proc), re.M)
    return sum(map(float, found))


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack  # (conftest.py: one stack of the defaults for the modules that only send requests)


@pytest.mark.slow
def test_routed_requests_come_on_the_routers_open_call_not_one_call_each(stack):
    before = received(stack.prefill[0], "PrefillStream")
    assert before >= 1  # the router's own warm-up request came that way too
    outs = [generate(stack.router.address, [5, 6, 7, 8 + i], SamplingParams(max_new_tokens=3, ignore_eos=True))
            for i in range(4)]
    assert all(len(o.output_ids) == 3 for o in outs)
    assert received(stack.prefill[0], "PrefillStream") == before + 4


@pytest.mark.slow
def test_a_raw_calls_prompt_and_bind_give_the_routed_tokens_and_a_cancelled_prompt_holds_nothing(stack):
    prompt_ids = [31, 32, 33, 34, 35, 36, 37]
    params = gen_pb.SamplingParams(max_new_tokens=4)
    commands: queue.Queue = queue.Queue()

    def requests():
        while (msg := commands.get()) is not None:
            yield msg

    with grpc.insecure_channel(stack.decode[0].address) as dch, grpc.insecure_channel(stack.prefill[0].address) as pch:
        decode, prefill = pb_grpc.DecodeWorkerStub(dch), pb_grpc.PrefillWorkerStub(pch)
        reserve = decode.Reserve(pb.ReserveRequest(request_id="raw", input_ids=prompt_ids, sampling_params=params),
                                 timeout=10)
        updates = ThreadPoolExecutor(1).submit(decode_updates, decode, "raw")
        call = prefill.PrefillStream(requests(), timeout=60)
        # A prompt never bound (parked with its pages held), cancelled; then one with its bind in the same message.
        commands.put(pb.PrefillStreamRequest(prefill=[pb.PrefillRequest(request_id="parked", input_ids=prompt_ids,
                                                                         sampling_params=params)]))
        time.sleep(0.5)  # computed and parked by now on this tiny model
        commands.put(pb.PrefillStreamRequest(cancel=["parked"]))
        commands.put(pb.PrefillStreamRequest(
            prefill=[pb.PrefillRequest(request_id="raw", input_ids=prompt_ids, sampling_params=params)],
            bind=[pb.BindRequest(request_id="raw", destination=reserve)]))
        answer = next(iter(call)).answers
        commands.put(None)  # the router's side closes: the call ends once nothing is in flight
        rest = list(call)
        tokens = [t for u in updates.result(30) for t in u.token_ids]
    assert [a.request_id for a in answer] == ["raw"] and rest == []  # no answer for the cancelled prompt
    assert tokens[0] == answer[0].response.first_token_id and len(tokens) == 4
    assert generate(stack.router.address, prompt_ids, SamplingParams(max_new_tokens=4)).output_ids == tokens
    idle = wait_idle(stack.prefill[0])
    assert idle.num_free_pages == idle.num_total_pages and idle.num_running_requests == 0, idle
