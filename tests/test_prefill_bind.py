"""A prompt computed before its KV destination is known (the router reserves on the decode worker meanwhile): the
prefill engine holds it COMPUTED (pages held, aux kept) and ships it at its bind with the rows and aux record a job
bound from the start ships; a bind during the forward streams the layers computed so far at once; an aborted COMPUTED
prompt lets its pages go; a transfer's end takes its request out of the engine. Through a real prefill worker's PrefillStream: a bind in the prompt's message or after the prompt was
computed, a second bind, a bind without its destination, and no bind at all."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.kv_transfer import KVTransferError, TransferState
from pdserve.prefill_service.engine import Phase, PrefillEngine, PrefillJob
from pdserve.prefill_service.server import PrefillServicer, PrefillWorker, PrefillWorkerConfig
from pdserve.sampling import SamplingParams
from pdserve.serving.metrics import Metrics
from pdserve.serving.rpc_convert import layout_to_proto
from pdserve.serving.worker_common import WorkerIdentity
from pdserve.spec_decode import SpeculativeConfig
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from stack import decode_updates, generate, wait_idle
from test_prefill_streaming import BulkRecordingHandle, RecordingHandle, add_bound

PROMPT = "The router sends each request to a prefill worker"
SPECULATING = SpeculativeConfig("NEXTN", 2)


def engine_of(tiny_v3_dir, speculative=SPECULATING) -> PrefillEngine:
    return PrefillEngine(LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=64),
                                                speculative=speculative)), sender=None)


def run_bound(tiny_v3_dir, handle, ships_mtp=True):
    """The reference: the same prompt on a fresh engine, bound from the start."""
    engine = engine_of(tiny_v3_dir)
    add_bound(engine, PrefillJob("r", engine.core.encode(PROMPT), SamplingParams()), handle, ships_mtp)
    results = []
    while engine.has_work:
        results += engine.step()
    return results


def assert_same_shipment(got, reference) -> None:
    assert sorted(got.layers) == sorted(reference.layers)
    for layer in reference.layers:
        torch.testing.assert_close(got.layers[layer], reference.layers[layer], rtol=0, atol=0)
    assert got.aux["first_token_id"] == reference.aux["first_token_id"]
    assert got.aux["rng_state"] == reference.aux["rng_state"]
    torch.testing.assert_close(got.aux["hidden"], reference.aux["hidden"], rtol=0, atol=0)


@pytest.mark.parametrize("handle_cls", [RecordingHandle, BulkRecordingHandle])
@pytest.mark.parametrize("ships_mtp", [True, False])
def test_a_prompt_computed_before_its_bind_is_held_then_shipped_as_if_bound(tiny_v3_dir, handle_cls, ships_mtp):
    engine = engine_of(tiny_v3_dir)
    alloc = engine.pool.allocator
    prompt = engine.core.encode(PROMPT)
    engine.add(PrefillJob("r", prompt, SamplingParams()))
    assert engine.records["r"].phase is Phase.QUEUED
    results = []
    while engine.has_work:
        results += engine.step()
    assert results == [] and not engine.has_work  # computed, nothing shipped: no destination yet
    assert engine.records["r"].phase is Phase.COMPUTED
    held_pages = -(-len(prompt) // 4)
    assert engine.core.kv_pages_in_use_by_requests() >= held_pages  # held past the request's end
    handle = handle_cls([])
    engine.bind("r", handle, ships_mtp)
    shipped = engine.take_binds()
    assert [r.request_id for r in shipped] == ["r"] and engine.records["r"].phase is Phase.SENDING
    assert shipped[0].first_token_id == handle.aux["first_token_id"]
    assert engine.core.kv_pages_in_use_by_requests() == 0
    assert alloc.num_free + alloc.num_tracked_alone == alloc.num_pages  # the prefix cache's alone
    reference = RecordingHandle([])
    assert run_bound(tiny_v3_dir, reference, ships_mtp)[0].first_token_id == shipped[0].first_token_id
    assert_same_shipment(handle, reference)
    assert engine.take_binds() == []


def test_a_bound_prompts_result_goes_to_on_first_tokens_before_its_kv_is_handed_over(tiny_v3_dir):
    """The worker answers a prompt from on_first_tokens: told at the sampling, before the hand-off, and only for bound
    prompts without logprobs; step() leaves those out and returns the others; the hand-off is what a job without
    the callback gets."""
    events, told = [], []
    engine = engine_of(tiny_v3_dir, speculative=SpeculativeConfig())  # (logprobs: a worker that does not speculate)
    engine.on_first_tokens = lambda results: [(told.append(r), events.append(f"told {r.request_id}")) for r in results]
    prompt = engine.core.encode(PROMPT)
    early = BulkRecordingHandle(events)
    add_bound(engine, PrefillJob("early", prompt, SamplingParams()), early, ships_mtp=False)
    with_logprobs = BulkRecordingHandle([])
    add_bound(engine, PrefillJob("logprobs", prompt, SamplingParams(logprobs=2)), with_logprobs, ships_mtp=False)
    engine.add(PrefillJob("parked", prompt, SamplingParams()))
    results = []
    while engine.has_work:
        results += engine.step()
    assert [r.request_id for r in told] == ["early"]
    assert events[0] == "told early" and events[-1] == "finish"  # told first, then its layers and aux went
    assert [r.request_id for r in results] == ["logprobs"] and with_logprobs.aux is not None
    reference = RecordingHandle([])
    assert run_bound(tiny_v3_dir, reference, ships_mtp=False)[0].first_token_id == told[0].first_token_id == early.aux["first_token_id"]
    assert sorted(early.layers) == sorted(reference.layers)  # (a batch of three: fp32 sums may differ in the last bit)
    for layer in reference.layers:
        torch.testing.assert_close(early.layers[layer], reference.layers[layer], rtol=0, atol=1e-5)
    engine.bind("parked", BulkRecordingHandle([]), False)
    assert [r.request_id for r in engine.take_binds()] == ["parked"] and len(told) == 1  # computed first: not told
    assert engine.core.kv_pages_in_use_by_requests() == 0


def test_a_bind_during_the_forward_streams_the_layers_computed_so_far_then_the_rest(tiny_v3_dir):
    engine = engine_of(tiny_v3_dir)
    events: list[str] = []
    handle = RecordingHandle(events)
    main = engine.num_main_layers
    assert main >= 3  # (layer 1 is done before the last one starts)

    def bind_once(*_) -> None:  # the bind comes (the servicer's call) as layer 1 of the final chunk starts
        if "bind" not in events:
            events.append("bind")
            engine.bind("r", handle, True)

    engine.core.model.layers[1].register_forward_pre_hook(bind_once)
    engine.core.model.layers[-1].register_forward_pre_hook(lambda *_: events.append("last layer starts"))
    engine.add(PrefillJob("r", engine.core.encode(PROMPT), SamplingParams()))
    results = []
    while engine.has_work:
        results += engine.step()
    assert [r.request_id for r in results] == ["r"] and engine.records["r"].handle is handle
    sends = [e for e in events if e.startswith("send")]
    # Layer 0 was computed before the bind: it goes at layer 1's end with it, during the forward, then one per layer.
    assert events.index("bind") < events.index("send 0") < events.index("send 1") < events.index("last layer starts")
    assert sends == [f"send {i}" for i in range(engine.core.model_config.num_kv_layers)] and events[-1] == "finish"
    reference = RecordingHandle([])
    run_bound(tiny_v3_dir, reference)
    assert_same_shipment(handle, reference)


def test_an_aborted_computed_prompt_lets_its_pages_go_and_a_late_bind_is_aborted(tiny_v3_dir):
    engine = engine_of(tiny_v3_dir)
    alloc = engine.pool.allocator
    engine.add(PrefillJob("r", engine.core.encode(PROMPT), SamplingParams()))
    while engine.has_work:
        engine.step()
    assert engine.core.kv_pages_in_use_by_requests() > 0
    assert engine.abort("r") and "r" not in engine.records
    assert engine.core.kv_pages_in_use_by_requests() == 0
    assert alloc.num_free + alloc.num_tracked_alone == alloc.num_pages  # the prefix cache's alone
    late = RecordingHandle([])
    engine.bind("r", late, True)
    assert engine.take_binds() == [] and late.events == ["abort"] and not late.layers
    # Aborted while still queued: the same.
    engine.add(PrefillJob("s", engine.core.encode(PROMPT), SamplingParams()))
    assert engine.abort("s") and not engine.has_work and not engine.records
    assert engine.core.kv_pages_in_use_by_requests() == 0


class EndingHandle(RecordingHandle):
    """A room whose transfer ends when the test says, as the test says."""

    def __init__(self, events):
        super().__init__(events)
        self.state, self.error = TransferState.TRANSFERRING, None

    def poll(self) -> TransferState:
        return self.state

    def wait(self, timeout=None):
        if self.error is not None:
            raise self.error
        return super().wait(timeout)


def test_a_sent_prompt_stays_sending_until_its_transfer_ends_and_an_abort_then_aborts_the_transfer(tiny_v3_dir):
    engine = engine_of(tiny_v3_dir)
    prompt = engine.core.encode(PROMPT)
    handles = {rid: EndingHandle([]) for rid in ("done", "failed", "aborted")}
    for rid, handle in handles.items():
        add_bound(engine, PrefillJob(rid, prompt, SamplingParams()), handle)
    while engine.has_work:
        engine.step()
    assert {rid: r.phase for rid, r in engine.records.items()} == dict.fromkeys(handles, Phase.SENDING)
    assert engine.poll_transfers() == [] and engine.num_sending == 3
    handles["done"].state = TransferState.DONE
    handles["failed"].state = TransferState.FAILED
    handles["failed"].error = KVTransferError("peer_failed", "the decode worker went away")
    ended = {rec.request_id: (rec.phase, outcome) for rec, outcome in engine.poll_transfers()}
    assert ended["done"][0] is Phase.DONE and ended["done"][1].bytes_sent > 0
    assert ended["failed"] == (Phase.FAILED, handles["failed"].error)
    assert list(engine.records) == ["aborted"] and engine.num_sending == 1
    assert engine.abort("aborted") and handles["aborted"].events[-1] == "abort" and not engine.records
    assert not engine.abort("done")  # ended already: unknown
    engine.add(PrefillJob("done", prompt, SamplingParams()))  # its id may come again
    assert engine.records["done"].phase is Phase.QUEUED


def in_process_worker(tiny_v3_dir) -> PrefillWorker:
    """A prefill worker without its gRPC server (call PrefillServicer's methods; start() it on a running loop)."""
    engine = EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=64))
    return PrefillWorker(PrefillWorkerConfig(engine, warmup=False),
                         WorkerIdentity("prefill-test", "prefill", "127.0.0.1:0"), Metrics.create("prefill"))


def prompt_of(worker: PrefillWorker, rid: str = "r") -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=rid, input_ids=worker.core.encode(PROMPT))


def bound(worker: PrefillWorker) -> asyncio.Future:
    """A prompt's destination that came already (skip_mtp_kv); pair it with `worker.sender.begin = lambda *a:
    handle`. On the running loop."""
    destination = asyncio.get_running_loop().create_future()
    destination.set_result(pb.ReserveResponse(dst_pages=list(range(16)), layout=layout_to_proto(worker.layout),
                                              skip_mtp_kv=True))
    return destination


@pytest.mark.parametrize("during", ["add", "connect"])
def test_a_prompt_dropped_midway_leaves_no_pages_and_no_open_handle_behind(tiny_v3_dir, during):
    """The router can drop a prompt (its cancel, its deadline ending the call) while the engine thread runs its add,
    or while a thread opens its KV connection: that work goes on all the same, so the prompt must undo it when it
    ends (a leak of this kind once held pages for good under short deadlines)."""
    worker = in_process_worker(tiny_v3_dir)
    midway, go_on = threading.Event(), threading.Event()

    def held_up(fn):
        def run(*args):
            midway.set()
            go_on.wait(10)
            return fn(*args)
        return run

    handle = RecordingHandle([])
    handle.transport = "tcp"
    worker.sender.begin = lambda *args: handle  # the bind's destination, without a decode worker
    if during == "connect":
        worker.sender.begin = held_up(worker.sender.begin)
    else:
        worker.engine.add = held_up(worker.engine.add)

    async def cancel_midway() -> pb.WorkerLoad:
        worker.start(asyncio.get_running_loop())
        call = asyncio.ensure_future(PrefillServicer(worker).prefill(prompt_of(worker), bound(worker)))
        assert await asyncio.to_thread(midway.wait, 10)
        call.cancel()  # the other thread is inside the add (or the connect): the cancel cannot stop it
        with pytest.raises(asyncio.CancelledError):
            await call
        go_on.set()
        for _ in range(200):
            load = await asyncio.wrap_future(worker.loop.submit(worker.load))
            if not worker.engine.has_work and load.num_free_pages == load.num_total_pages \
                    and (handle.events or during == "add"):
                break
            await asyncio.sleep(0.02)
        return load

    try:
        load = asyncio.run(cancel_midway())
    finally:
        worker.loop.stop()
    assert load.num_free_pages == load.num_total_pages and load.num_running_requests == 0, load
    assert not worker.engine.has_work
    assert handle.events == ([] if during == "add" else ["abort"]), handle.events


def test_a_destination_already_paired_is_opened_on_the_event_loop_not_on_a_thread(tiny_v3_dir):
    """Where the sender holds a live pairing with the decode worker (every prompt after the first), the room is
    opened right on the event loop (begin_if_paired): no executor thread takes the GIL from the engine thread for it.
    Without a pairing, begin runs on a thread as before."""
    worker = in_process_worker(tiny_v3_dir)
    paired = RecordingHandle([])
    paired.transport = "tcp"
    opened_on: list[str] = []

    def begin_if_paired(*args):
        opened_on.append(threading.current_thread().name)
        return paired

    def begin(*args):
        raise AssertionError("begin() (the thread path) for a destination already paired")

    worker.sender.begin_if_paired, worker.sender.begin = begin_if_paired, begin

    async def prefill() -> pb.PrefillResponse:
        worker.start(asyncio.get_running_loop())
        return await PrefillServicer(worker).prefill(prompt_of(worker), bound(worker))

    try:
        response = asyncio.run(prefill())
    finally:
        worker.loop.stop()
    assert opened_on == ["MainThread"]
    assert response.first_token_id >= 0 and paired.events[-1] == "finish", paired.events


def test_the_destinations_checks_come_before_anything_is_sent(tiny_v3_dir):
    plain = engine_of(tiny_v3_dir, SpeculativeConfig())
    job = PrefillJob("r", plain.core.encode(PROMPT), SamplingParams())
    with pytest.raises(ValueError, match="--speculative-algorithm"):
        plain.check_destination(job, list(range(16)), ships_mtp=True)
    with pytest.raises(ValueError, match="decode reserved 1 pages but the prompt needs"):
        plain.check_destination(job, [0], ships_mtp=False)
    plain.check_destination(job, list(range(16)), ships_mtp=False)


# ---- through a real prefill worker ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack  # (conftest.py: one stack of the defaults for the modules that only send requests)


def _reserve(decode_stub, rid, prompt, max_new_tokens=4) -> pb.ReserveResponse:
    params = gen_pb.SamplingParams(max_new_tokens=max_new_tokens)
    return decode_stub.Reserve(pb.ReserveRequest(request_id=rid, input_ids=prompt, sampling_params=params), timeout=10)


def _bind_request(rid, reserve: pb.ReserveResponse) -> pb.BindRequest:
    return pb.BindRequest(request_id=rid, destination=reserve)


def _prefill_request(rid, prompt, max_new_tokens=4) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=rid, input_ids=prompt,
                             sampling_params=gen_pb.SamplingParams(max_new_tokens=max_new_tokens))


class RawCall:
    """A PrefillStream call the test writes messages to (`send`, `close`: the router's side ends) and reads the
    answers of (`answers`, an iterator of PrefillStreamResponse)."""

    def __init__(self, stub: pb_grpc.PrefillWorkerStub, timeout: float):
        self.commands: queue.Queue = queue.Queue()
        self.answers = iter(stub.PrefillStream(iter(self.commands.get, None), timeout=timeout))

    def send(self, **fields) -> None:
        self.commands.put(pb.PrefillStreamRequest(**fields))

    def close(self) -> None:
        self.commands.put(None)


def _failure_of(answer: pb.PrefillAnswer) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == answer.failure.code)


@pytest.mark.slow
@pytest.mark.parametrize("bind_later", [False, True])
def test_a_bind_in_the_prompts_message_or_after_it_was_computed_gives_the_tokens_of_a_routed_request(stack,
                                                                                                   bind_later):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    rid = f"bind-{bind_later}"
    pool = ThreadPoolExecutor(3)
    with grpc.insecure_channel(stack.decode[0].address) as dch, grpc.insecure_channel(stack.prefill[0].address) as pch:
        decode = pb_grpc.DecodeWorkerStub(dch)
        call = RawCall(pb_grpc.PrefillWorkerStub(pch), timeout=30)
        reserve = _reserve(decode, rid, prompt)
        updates = pool.submit(decode_updates, decode, rid)
        if bind_later:
            call.send(prefill=[_prefill_request(rid, prompt)])
            answer = pool.submit(next, call.answers)
            time.sleep(0.5)  # computed by now on this tiny model
            assert not answer.done()  # it waits for its destination
            call.send(bind=[_bind_request(rid, reserve)])
        else:
            call.send(prefill=[_prefill_request(rid, prompt)], bind=[_bind_request(rid, reserve)])
            answer = pool.submit(next, call.answers)
        answers = answer.result(30).answers
        call.close()
        assert list(call.answers) == []
        tokens = [t for u in updates.result(30) for t in u.token_ids]
    assert [a.request_id for a in answers] == [rid] and answers[0].HasField("response"), answers
    assert tokens[0] == answers[0].response.first_token_id and len(tokens) == 4
    assert generate(stack.router.address, prompt, SamplingParams(max_new_tokens=4)).output_ids == tokens
    idle = wait_idle(stack.prefill[0])
    assert idle.num_free_pages == idle.num_total_pages and idle.num_running_requests == 0, idle


@pytest.mark.slow
def test_a_second_bind_is_already_exists_and_a_prompt_never_bound_ends_with_its_calls_deadline_holding_nothing(stack):
    """(and a bind without its destination is INVALID_ARGUMENT)"""
    prompt = [21, 22, 23, 24, 25, 26]
    with grpc.insecure_channel(stack.decode[0].address) as dch, grpc.insecure_channel(stack.prefill[0].address) as pch:
        decode, prefill = pb_grpc.DecodeWorkerStub(dch), pb_grpc.PrefillWorkerStub(pch)
        reserve = _reserve(decode, "twice", prompt)
        call = RawCall(prefill, timeout=30)
        call.send(prefill=[_prefill_request("twice", prompt)],
                  bind=[_bind_request("twice", reserve), _bind_request("twice", reserve)])
        second = next(call.answers).answers
        assert [a.request_id for a in second] == ["twice"] and _failure_of(second[0]) == grpc.StatusCode.ALREADY_EXISTS
        call.send(prefill=[_prefill_request("no-destination", prompt)],
                  bind=[pb.BindRequest(request_id="no-destination")])
        empty = next(call.answers).answers
        assert _failure_of(empty[0]) == grpc.StatusCode.INVALID_ARGUMENT and "destination" in empty[0].failure.message
        call.close()
        assert list(call.answers) == []
        decode.Abort(pb.AbortRequest(request_id="twice"), timeout=10)
        unbound = RawCall(prefill, timeout=1.0)
        unbound.send(prefill=[_prefill_request("never-bound", prompt)])
        with pytest.raises(grpc.RpcError) as ended:
            next(unbound.answers)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value
    idle = wait_idle(stack.prefill[0], 10)
    assert idle.num_free_pages == idle.num_total_pages and idle.num_running_requests == 0, idle
