"""One attempt at a request across a prefill and a decode worker, as the router relays it to its client.

A request's phases, each a method of `Relay`, in this order (`Router.generate` chose the two workers, and retries on
other workers an attempt that failed as unreachable before any token reached the client):

    send_prompt -> reserve_decode -> bind -> stream_tokens -> finish -> close
    an early exit from any phase                                     -> close, failing the request on both workers

- send_prompt: the prompt goes to the prefill worker on the router's open PrefillStream call (prefill_streams.py),
  without a destination: the worker computes it while the decode worker reserves pages.
- reserve_decode: Reserve on the decode worker, which has the prompt's forward to answer in.
- bind: the reservation goes to the prefill worker as the prompt's destination (a Bind on its open call), and the
  request attaches to the decode worker's open DecodeStream call (decode_streams.py).
- stream_tokens: the request's feed collects everything that can happen to it: the decode worker's updates, the
  prefill worker's answer (its first token goes out at once, ahead of the decode worker's stream: first_token.py),
  a prefill failure, a worker taken out of routing, the deadline. One wake-up per batch of updates: the tokens that
  queued meanwhile (a client reading slower than the engine steps) go out in one chunk, and after the first token at
  least `stream_interval` at a time.
- finish: the `complete` message, the request's metrics, and the prefix the prefill worker now holds recorded.
- close: the attempt's end, whichever way. After an early exit (a worker's failure, the deadline, the client gone) the
  decode call cancels the request and the prompt's answer is cancelled, so both workers free its pages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import grpc

from pdserve.common.tokenizer import Tokenizer
from pdserve.common.trace import mark
from pdserve.common.values import SamplingParams
from pdserve.serving.grpc_shell import ServiceError
from pdserve.serving.metrics import Metrics
from pdserve.serving.rpc_convert import sampling_to_proto
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb

from .call_failed import CallFailed, failure_of
from .decode_streams import DecodeCall, DecodeStreams
from .first_token import EarlyFirstToken
from .prefill_streams import PrefillCall, PrefillStreams
from .workers import Worker, WorkerDown


@dataclass(frozen=True)
class RelayLinks:
    """What the relays of one router share: its open calls to the workers and what a finished request updates."""
    prefill_streams: PrefillStreams
    decode_streams: DecodeStreams
    metadata: tuple  # the workers' call metadata (the internal token)
    stream_interval: int
    tokenizer: Optional[Tokenizer]
    model_info: Callable[[], gen_pb.ModelInfo]
    # learn_ownership(prefill, prompt_ids, hashes, answer): the prompt's blocks are now held by that prefill worker
    learn_ownership: Callable[[Worker, list[int], Optional[list[bytes]], pb.PrefillResponse], None]


@dataclass(frozen=True)
class RelayRequest:
    """One attempt's request: `rid` is the id the workers see; `hashes` the prompt's block keys from the routing
    (None: made when the ownership is learnt); `arrival` and `deadline` monotonic seconds (None: no deadline)."""
    rid: str
    ids: list[int]
    params: SamplingParams
    hashes: Optional[list[bytes]]
    arrival: float
    deadline: Optional[float]


class Relay:
    """One attempt at one request on a chosen prefill and decode worker: iterate `run()` for its messages."""

    def __init__(self, links: RelayLinks, request: RelayRequest, prefill: Worker, decode: Worker, metrics: Metrics):
        self.links, self.req, self.prefill, self.decode, self.m = links, request, prefill, decode, metrics
        params = request.params
        self.sampling = sampling_to_proto(params)
        self.feed: asyncio.Queue = asyncio.Queue()  # everything that can happen to the request, in order
        self.down: Optional[asyncio.Future] = None  # the first of the watched workers taken out of routing
        self.prefill_call: Optional[PrefillCall] = None
        self.answer: Optional[asyncio.Future] = None  # the prefill worker's PrefillResponse
        self.decode_call: Optional[DecodeCall] = None
        self.deadline_timer: Optional[asyncio.TimerHandle] = None
        # The first token sent from the prefill worker's answer, except with logprobs (the first token's and the
        # prompt's come in that answer, spliced into the decode worker's stream instead).
        self.early = (None if params.wants_logprobs else
                      EarlyFirstToken(params, request.ids, links.model_info().eos_token_ids, links.tokenizer))
        self.prefill_resp: Optional[pb.PrefillResponse] = None  # once its logprobs were spliced in
        self.output_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[gen_pb.TokenLogprobs] = []
        self.last_out: Optional[float] = None  # when tokens last went to the client
        self.decoding = False  # the decode worker's stream has begun (counted in decode.decoding)
        self.finished = False  # the decode worker sent the request's last update
        self.ended = False  # this attempt is over: late callbacks do nothing

    async def run(self) -> AsyncIterator[gen_pb.GenerateResponse]:
        """Chunks of new tokens, then one `complete` message; a worker's failure raises (CallFailed, AioRpcError,
        WorkerDown, ServiceError)."""
        # Ends this attempt at once if either worker is taken out of routing (frozen, stalled, gone) meanwhile.
        self.down = asyncio.ensure_future(_first_down(self.prefill, self.decode))
        try:
            _left(self.req.deadline)  # (raises if it has passed)
            self.send_prompt()
            reserve = await self.reserve_decode()
            self.bind(reserve)
            async for msg in self.stream_tokens():
                yield msg
        finally:
            self.close()

    # ---- phases --------------------------------------------------------------------------------------------------
    def send_prompt(self) -> None:
        """The prompt, without its destination (a Bind follows)."""
        self.prefill_call = self.links.prefill_streams.to(self.prefill)
        self.answer = self.prefill_call.prefill(pb.PrefillRequest(
            request_id=self.req.rid, input_ids=self.req.ids, sampling_params=self.sampling))
        self.answer.add_done_callback(self._prefill_answered)

    async def reserve_decode(self) -> pb.ReserveResponse:
        """Pages on the decode worker for the prompt and its new tokens."""
        call = asyncio.ensure_future(self.decode.stub.Reserve(
            pb.ReserveRequest(request_id=self.req.rid, input_ids=self.req.ids, sampling_params=self.sampling),
            timeout=_left(self.req.deadline), metadata=self.links.metadata))
        try:
            await asyncio.wait({call, self.down, self.answer}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the request ended (client gone, deadline) as the reservation came
            if call.done() and not call.cancelled() and call.exception() is None:
                # Nobody will attach it: attached here to be cancelled by close(), its pages go now rather than at
                # the decode worker's attach deadline.
                self.decode_call = self.links.decode_streams.attach(self.decode, self.req.rid, self.feed)
            raise
        finally:
            if not call.done():
                call.cancel()  # the decode worker releases what it reserved when the call ends
        if not call.done():
            if self.down.done():
                raise WorkerDown(self.down.result())
            await self.answer  # it waits for its Bind: done before the reservation means it failed
            raise ServiceError(grpc.StatusCode.INTERNAL, "the prefill worker answered before its KV destination")
        reserve: pb.ReserveResponse = call.result()  # (its failure ends the attempt, and the prompt)
        mark("router.reserved", self.req.rid)
        return reserve

    def bind(self, reserve: pb.ReserveResponse) -> None:
        """The reservation to the prefill worker as the prompt's destination; the decode worker's updates to the
        feed; from now on either worker going down, or the deadline, ends the attempt."""
        rid = self.req.rid
        self.decode_call = self.links.decode_streams.attach(self.decode, rid, self.feed)
        self.prefill_call.bind(pb.BindRequest(request_id=rid, destination=reserve))  # (its failure fails the prompt)
        self._watch_down(self.prefill, self.decode)
        if self.req.deadline is not None:
            self.deadline_timer = asyncio.get_running_loop().call_later(
                max(0.0, self.req.deadline - time.monotonic()), self.feed.put_nowait,
                ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"))

    async def stream_tokens(self) -> AsyncIterator[gen_pb.GenerateResponse]:
        """The feed's tokens to the client, a batch of updates per wake-up, then `finish`."""
        chunk = gen_pb.GenerateChunk()
        while True:
            updates = [await self.feed.get()]
            while not self.feed.empty():
                updates.append(self.feed.get_nowait())
            done: Optional[pb.DecodeUpdate] = None
            for item in updates:
                update = self._token_update(item)
                if update is None:
                    continue
                await self._add(update, chunk)
                if update.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                    done = update
                    break  # nothing comes after a request's last update
            if done is None and self.last_out is not None and len(chunk.token_ids) < self.links.stream_interval:
                continue  # --stream-interval: after the first token, hold them until enough have come
            now = self._observe_out(len(chunk.token_ids))
            if chunk.token_ids or chunk.text or chunk.prompt_logprobs:
                yield gen_pb.GenerateResponse(request_id=self.req.rid, chunk=chunk)
            chunk = gen_pb.GenerateChunk()
            if done is not None:
                yield await self.finish(done, now)
                return

    async def finish(self, done: pb.DecodeUpdate, now: float) -> gen_pb.GenerateResponse:
        """The request's `complete` message, its metrics, and the prefix its prefill worker now holds."""
        self.finished = True
        req, m = self.req, self.m
        resp = await self.answer
        self.links.learn_ownership(self.prefill, req.ids, req.hashes, resp)
        m.e2e.observe(now - req.arrival)
        m.count(m.generated_tokens, len(self.output_ids))
        m.count(m.prompt_tokens, len(req.ids))
        m.count(m.prefix_hit_tokens, resp.cached_tokens)
        return gen_pb.GenerateResponse(request_id=req.rid, complete=gen_pb.GenerateComplete(
            output_ids=self.output_ids, finish_reason=done.finish_reason, usage=done.usage,
            text="".join(self.text), logprobs=self.logprobs,
            prompt_logprobs=resp.prompt_logprobs if req.params.prompt_logprobs is not None else []))

    def close(self) -> None:
        """The attempt's end, whichever way: unless the request finished, both workers drop it and free its
        pages."""
        self.ended = True
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
        if self.decode_call is not None and not self.finished:
            self.decode_call.cancel(self.req.rid)
        if self.answer is not None and not self.answer.done():
            self.answer.cancel()
        self.down.cancel()
        if self.decoding:
            self.decode.decoding -= 1

    # ---- steps within the phases ---------------------------------------------------------------------------------
    def _prefill_answered(self, answer: asyncio.Future) -> None:
        if answer.cancelled():
            return
        error = answer.exception()  # (read even when this attempt has ended, so that it counts as retrieved)
        if self.ended:  # (a callback scheduled just before this attempt ended)
            return
        if error is not None:
            self.feed.put_nowait(error)  # decode would only notice at its KV timeout
        else:  # the prefill worker's part is done: only the decode worker can hold this request up now
            mark("router.prefill_answer", self.req.rid)
            self._watch_down(self.decode)
            if self.early is not None:
                self.feed.put_nowait(answer.result())  # its first token, for the client at once

    def _watch_down(self, *workers: Worker) -> None:
        self.down.cancel()
        self.down = asyncio.ensure_future(_first_down(*workers))
        self.down.add_done_callback(lambda d: d.cancelled() or self.feed.put_nowait(WorkerDown(d.result())))

    def _token_update(self, item) -> Optional[pb.DecodeUpdate]:
        """A feed item as tokens for the client (None: nothing to send); an error in the feed raises."""
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, pb.PrefillResponse):  # the first token early, unless the decode worker's stream came first
            return self.early.update_for(item.first_token_id) if not self.output_ids else None
        if item.HasField("failure"):
            failure = failure_of(item.failure)
            if failure.code() == grpc.StatusCode.NOT_FOUND and not self.decoding:
                # Refused at attach: the decode worker released the reservation before the attach came (later than
                # its attach deadline). The request never ran there: retried elsewhere like an unreachable worker.
                raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.decode.address} had released the "
                                 f"reservation when it was attached ({failure.details()})")
            raise failure
        if self.early is not None:
            self.early.strip(item)
        if not self.decoding:
            mark("router.decode_first", self.req.rid)
            self.decoding = True
            self.decode.decoding += 1
        return item

    async def _add(self, update: pb.DecodeUpdate, chunk: gen_pb.GenerateChunk) -> None:
        """`update`'s tokens into `chunk` and the request's totals, with the prefill worker's logprobs spliced in
        (the prompt's, and the first token's in place of the decode worker's)."""
        params = self.req.params
        if params.wants_logprobs and self.prefill_resp is None:
            self.prefill_resp = await self.answer  # done or about to be: the KV it sent has arrived
            chunk.prompt_logprobs.extend(self.prefill_resp.prompt_logprobs)
            if params.logprobs is not None and update.logprobs and not self.output_ids:
                update.logprobs[0].CopyFrom(self.prefill_resp.first_token_logprobs)
        if params.logprobs is not None:
            chunk.logprobs.extend(update.logprobs)
            self.logprobs += update.logprobs
        chunk.token_ids.extend(update.token_ids)
        chunk.text += update.text
        self.output_ids += update.token_ids
        self.text.append(update.text)

    def _observe_out(self, num_tokens: int) -> float:
        """TTFT for the first message, else the inter-token gaps (tokens sent together share their gap)."""
        now = time.monotonic()
        if self.last_out is None:
            mark("router.first_out", self.req.rid)
            self.m.ttft.observe(now - self.req.arrival)
        elif num_tokens:
            gap = (now - self.last_out) / num_tokens
            for _ in range(num_tokens):
                self.m.itl.observe(gap)
        self.last_out = now
        return now


def _left(deadline: Optional[float]) -> Optional[float]:
    """Seconds left before the client's deadline (None: no deadline), for a worker call's timeout."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
    return left


async def _first_down(*workers: Worker) -> Worker:
    """The first of `workers` to be taken out of routing (waits while all are in)."""
    waits = {asyncio.ensure_future(w.down.wait()): w for w in workers}
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in waits:
            t.cancel()
    return waits[next(iter(done))]


__all__ = ["Relay", "RelayLinks", "RelayRequest"]
