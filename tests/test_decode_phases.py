"""A decode request's phases (decode_service/engine.py), on the engine alone with a stand-in receiver: RESERVED ->
RECEIVING -> RUNNING -> DONE, and every way to CANCELLED and FAILED, each freeing the request's pages exactly once
(pages a transfer may still be writing only at the receiver's last callback), each told to on_end once."""

from __future__ import annotations

import grpc
import pytest

from pdserve.decode_service.engine import DecodeEngine, Phase
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.kv_transfer import KVTransferError
from pdserve.sampling import SamplingParams
from pdserve.scheduler import SchedulerConfig
from pdserve.serving.grpc_shell import ServiceError

LAYERS = 2
PROMPT = [5, 6, 7, 8, 9, 10]  # two pages of 4
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


class Receiver:
    """Stands for RequestReceiver: `writing` says whether cancel finds the transport still writing a request's
    pages (it then owes the engine a last callback)."""

    def __init__(self):
        self.expected: dict[str, list[int]] = {}
        self.writing = False

    def expect(self, request_id, num_tokens, pages, num_layers) -> int:
        self.expected[request_id] = pages
        return 100 + len(self.expected)

    def cancel(self, request_id) -> bool:
        return not self.writing


class Harness:
    def __init__(self, model_dir, max_queued: int = 8):
        # (as a decode worker's: no prefix cache, a finished request's pages go back to the pool)
        self.core = LLMEngine(EngineConfig(str(model_dir), cache=CacheConfig(page_size=4, num_pages=32),
                                           scheduler=SchedulerConfig(enable_prefix_cache=False)))
        self.receiver = Receiver()
        self.delivered: list[tuple[str, object]] = []
        self.ended: list[tuple[str, Phase]] = []
        self.engine = DecodeEngine(self.core, self.receiver, LAYERS, deliver=self.delivered.extend,
                                   on_end=lambda r: self.ended.append((r.request_id, r.phase)), max_queued=max_queued)
        self.free_at_start = self.core.pool.allocator.num_free

    @property
    def pages_held(self) -> int:
        return self.free_at_start - self.core.pool.allocator.num_free

    def arrive(self, rid: str, layers: int = LAYERS, aux=None) -> None:
        for layer in range(layers):
            self.engine.kv_layer(rid, layer, None, None)  # (values None: the transport wrote the pages)
        self.engine.kv_done(rid, aux if aux is not None else {"first_token_id": 11, "cached_tokens": 0})

    def run(self) -> None:
        while self.engine.has_work:
            self.engine.step()


@pytest.fixture
def h(tiny_v3_dir):
    return Harness(tiny_v3_dir)


def test_reserved_receiving_running_done(h):
    r = h.engine.reserve("a", PROMPT, PARAMS)
    assert r.phase is Phase.RESERVED and h.pages_held == 2 and h.engine.awaiting_kv == 1
    h.engine.kv_layer("a", 0, None, None)
    assert r.phase is Phase.RECEIVING and h.engine.num_transferring == 1
    h.engine.kv_layer("a", 1, None, None)
    h.engine.kv_done("a", {"first_token_id": 11, "cached_tokens": 0})
    assert r.phase is Phase.RUNNING and r.pages == [] and h.engine.awaiting_kv == 0 == h.engine.num_transferring
    assert h.delivered[0][0] == "a" and h.delivered[0][1].new_token_ids == [11]  # the first token, at once
    h.run()
    assert r.phase is Phase.DONE and "a" not in h.engine.requests and h.ended == [("a", Phase.DONE)]
    tokens = [t for _, out in h.delivered for t in out.new_token_ids]
    assert len(tokens) == PARAMS.max_new_tokens and h.delivered[-1][1].finished
    assert h.pages_held == 0


def test_a_cancel_while_waiting_frees_the_pages_at_once(h):
    h.engine.reserve("a", PROMPT, PARAMS)
    assert h.engine.abort("a") and not h.engine.abort("a")
    assert h.pages_held == 0 and h.engine.requests == {} and h.ended == [("a", Phase.CANCELLED)]
    h.arrive("a")  # what the transport still had on its way is ignored
    assert h.pages_held == 0 and not h.engine.has_work and h.delivered == []


def test_pages_the_transport_may_still_write_are_freed_at_its_last_callback(h):
    r = h.engine.reserve("a", PROMPT, PARAMS)
    h.engine.kv_layer("a", 0, None, None)
    h.receiver.writing = True
    assert h.engine.abort("a")
    assert r.phase is Phase.CANCELLED and r.pages_in_transit and h.pages_held == 2
    assert h.engine.num_transferring == 1 and h.engine.awaiting_kv == 0  # (pacing waits for it no more)
    with pytest.raises(ValueError, match="already in use"):  # its id is still taken
        h.engine.reserve("a", PROMPT, PARAMS)
    h.arrive("a", layers=1)  # the last layer, then done: the writing is over
    assert h.pages_held == 0 and h.engine.requests == {} and h.engine.num_transferring == 0
    assert h.ended == [("a", Phase.CANCELLED)] and h.delivered == [] and not h.engine.has_work
    b = h.engine.reserve("b", PROMPT, PARAMS)
    h.engine.abort("b")
    h.engine.kv_failed("b", KVTransferError("aborted", "room closed"))  # a failure can be the last word too
    assert b.phase is Phase.CANCELLED and h.pages_held == 0 and h.engine.requests == {}


def test_a_running_request_cancelled_leaves_the_engine(h):
    h.engine.reserve("a", PROMPT, SamplingParams(max_new_tokens=50, ignore_eos=True))
    h.arrive("a")
    h.engine.step()
    assert h.engine.abort("a") and not h.engine.has_work and h.pages_held == 0
    assert h.ended == [("a", Phase.CANCELLED)]


@pytest.mark.parametrize("layers, aux, why", [
    (LAYERS, {"first_token_id": 10 ** 9, "cached_tokens": 0}, "outside the vocabulary"),
    (LAYERS, {"first_token_id": 11, "cached_tokens": 99}, "cached_tokens 99"),
    (LAYERS - 1, {"first_token_id": 11, "cached_tokens": 0}, "after 1 of 2 layers"),
])
def test_a_bad_transfer_fails_only_its_request(h, layers, aux, why):
    h.engine.reserve("ok", PROMPT, PARAMS)
    h.arrive("ok")
    r = h.engine.reserve("bad", PROMPT, PARAMS)
    h.arrive("bad", layers, aux)
    assert r.phase is Phase.FAILED and h.ended == [("bad", Phase.FAILED)]
    error = dict(h.delivered)["bad"]
    assert isinstance(error, KVTransferError) and error.kind == "protocol" and why in str(error)
    h.run()  # the other request decodes on
    assert h.ended[-1] == ("ok", Phase.DONE) and h.pages_held == 0


def test_a_failed_transfer_and_a_failed_step_fail_their_requests(h):
    h.engine.reserve("lost", PROMPT, PARAMS)
    timeout = KVTransferError("timeout", "no KV within 1 s")
    h.engine.kv_failed("lost", timeout)
    assert h.ended == [("lost", Phase.FAILED)] and dict(h.delivered)["lost"] is timeout and h.pages_held == 0
    h.engine.reserve("running", PROMPT, SamplingParams(max_new_tokens=50, ignore_eos=True))
    h.arrive("running")
    h.engine.reserve("waiting", PROMPT, PARAMS)
    step_failed = ServiceError(grpc.StatusCode.INTERNAL, "decode step failed")
    h.engine.fail_all(step_failed)
    assert sorted(h.ended[1:]) == [("running", Phase.FAILED), ("waiting", Phase.FAILED)]
    assert dict(h.delivered)["waiting"] is step_failed and dict(h.delivered)["running"] is step_failed
    assert h.engine.requests == {} and not h.engine.has_work and h.pages_held == 0


def test_a_full_queue_or_pool_is_refused_at_once(tiny_v3_dir):
    h = Harness(tiny_v3_dir, max_queued=2)
    h.engine.reserve("a", PROMPT, PARAMS)
    h.engine.reserve("b", PROMPT, PARAMS)
    with pytest.raises(ServiceError, match="queue is full") as full:
        h.engine.reserve("c", PROMPT, PARAMS)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    h.arrive("a")  # running: no longer waiting for its KV
    h.engine.reserve("c", PROMPT, PARAMS)
    with pytest.raises(ServiceError, match="no KV room"):
        Harness(tiny_v3_dir).engine.reserve("huge", list(range(5, 5 + 4 * 40)), PARAMS)
