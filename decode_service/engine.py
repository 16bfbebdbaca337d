"""The decode tier's engine: reserves pages for prompts a prefill worker computes, receives their latent KV into
those pages, and continues them in the engine's continuously batched decode loop (absorbed MLA).

Life of a request on a decode worker. One DecodeRequest per request, kept in `DecodeEngine.requests` and touched only
on the engine thread; each transition is one method of DecodeEngine:

    reserve()    -> RESERVED   pages allocated, the KV receiver expects the prompt's KV (its room goes to prefill
                               through the router)
    kv_layer()   -> RECEIVING  layers arrive: written into the pages by the transport, or copied in here (tcp)
    kv_done()    -> RUNNING    every layer and the aux record are in: admitted to the LLMEngine with its first token
                               (the LLMEngine owns its pages from here), decoding
    step()       -> DONE       finished (length, stop); the LLMEngine freed its pages
    abort()      -> CANCELLED  the router let go (its call ended, or it cancelled); from any live phase
    kv_failed(), a bad aux record, fail_all() (a failed step)
                 -> FAILED     the request's stream is told why

Pages are never leaked: every way out of RESERVED and RECEIVING frees them, except one: a request that ends while
the transport may still be writing its pages (`receiver.cancel` says so) keeps them, and its record, until the
receiver's last callback for it (`kv_done` or `kv_failed`) says the writing is over.

What the engine hands back goes through `deliver(items)`, (request id, RequestOutput or exception) pairs, once per
step; `on_end(request)` is told each request that reached DONE, CANCELLED or FAILED (the worker's metrics).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from pdserve.common.trace import mark
from pdserve.engine import LLMEngine, RequestOutput, StepHooks
from pdserve.kv_transfer import KVTransferError, RequestReceiver
from pdserve.sampling import SamplingParams
from pdserve.serving.grpc_shell import exhausted

log = logging.getLogger(__name__)

Items = list[tuple[str, object]]  # (request id, RequestOutput or exception)


class Phase(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


# Which phase may follow which (the three last ones end a request).
NEXT = {
    Phase.RESERVED: {Phase.RECEIVING, Phase.CANCELLED, Phase.FAILED},
    Phase.RECEIVING: {Phase.RUNNING, Phase.CANCELLED, Phase.FAILED},
    Phase.RUNNING: {Phase.DONE, Phase.CANCELLED, Phase.FAILED},
    Phase.DONE: set(), Phase.CANCELLED: set(), Phase.FAILED: set(),
}
AWAITING_KV = (Phase.RESERVED, Phase.RECEIVING)


@dataclass(eq=False)
class DecodeRequest:
    request_id: str
    room: int  # the transfer's id on the wire, handed to prefill through the router
    prompt_ids: list[int]
    params: SamplingParams
    pages: list[int]  # held by this record until RUNNING (then the LLMEngine's); [] once freed
    arrival_time: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.RESERVED
    layers_received: int = 0
    error: Optional[BaseException] = None  # why it FAILED
    # Ended (CANCELLED or FAILED) while the transport may still write its pages: they are freed at the receiver's
    # last callback for it, and the record stays in the table until then.
    pages_in_transit: bool = False

    @property
    def ended(self) -> bool:
        return not NEXT[self.phase]


class DecodeEngine(StepHooks):
    """Requests from reservation to their last token, over an LLMEngine whose step it plugs into (StepHooks)."""

    def __init__(self, core: LLMEngine, receiver: RequestReceiver, num_layers_expected: int,
                 deliver: Callable[[Items], None], on_end: Callable[[DecodeRequest], None] = lambda r: None,
                 max_queued: int = 256):
        """deliver(items) and on_end(request) are called on the engine thread. max_queued: requests reserved and
        still waiting for their KV; beyond it a reservation is answered "full" at once."""
        self.core, self.receiver = core, receiver
        self.pool = core.pool
        self.num_layers_expected = num_layers_expected
        self.deliver, self.on_end = deliver, on_end
        self.max_queued = max_queued
        self.requests: dict[str, DecodeRequest] = {}
        self._count = {phase: 0 for phase in Phase}  # records in the table, by phase
        # A speculative round's outputs, held until the next round waits for the GPU (before_device_wait).
        self._unsent: list[RequestOutput] = []
        core.hooks = self

    # ---- what the worker reads ------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.core.has_unfinished

    @property
    def awaiting_kv(self) -> int:
        """Requests reserved here whose KV has not all arrived: prompts still being prefilled for this worker."""
        return self._count[Phase.RESERVED] + self._count[Phase.RECEIVING]

    @property
    def num_transferring(self) -> int:
        """Requests whose pages a transfer holds: awaiting their KV, or ended while the transport still writes."""
        return len(self.requests) - self._count[Phase.RUNNING]

    # ---- transitions ---------------------------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> DecodeRequest:
        """-> RESERVED. ValueError for a request this worker cannot take, ServiceError (RESOURCE_EXHAUSTED) when it
        has no room now."""
        if request_id in self.requests or self.core.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use on this decode worker")
        self.core.encode(prompt_ids)  # vocabulary check
        self.core.check_logprobs(params)
        if params.stop and self.core.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer and this model has no tokenizer.json")
        max_len = self.core.scheduler.config.max_model_len
        if len(prompt_ids) + 1 > max_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the limit is {max_len - 1}")
        if self.awaiting_kv >= self.max_queued:
            raise exhausted(f"this decode worker's queue is full ({self.max_queued} requests waiting for their KV, "
                            "--max-queued-requests); retry later or add decode workers")
        needed = -(-len(prompt_ids) // self.pool.page_size)
        pages = self.core.prefix_cache.alloc_with_eviction(needed)
        if pages is None:
            free = self.pool.allocator.num_free
            raise exhausted(f"no KV room on this decode worker: the prompt needs {needed} pages, {free} are free")
        try:
            room = self.receiver.expect(request_id, len(prompt_ids), pages, self.num_layers_expected)
        except BaseException:
            self.pool.allocator.decref(pages)
            raise
        r = DecodeRequest(request_id, room, list(prompt_ids), params, pages)
        self.requests[request_id] = r
        self._count[r.phase] += 1
        return r

    def kv_layer(self, request_id: str, layer: int, slots: torch.Tensor, values: Optional[torch.Tensor]) -> None:
        """RESERVED -> RECEIVING at the first layer. values None: the transport already wrote the layer into the
        pages (nccl, gloo, cuda_ipc)."""
        r = self.requests.get(request_id)
        if r is None or r.ended:  # ended meanwhile: what still arrives is not wanted
            return
        if values is not None:
            kv = self.pool.kv
            kv[layer].index_copy_(0, slots.to(kv.device), values.to(kv.device, kv.dtype))
        r.layers_received += 1
        if r.phase is Phase.RESERVED:
            self._move(r, Phase.RECEIVING)

    def kv_done(self, request_id: str, aux: dict) -> None:
        """RECEIVING -> RUNNING: the first token goes out at once. The aux record comes from a peer: a bad value
        fails this request (FAILED), never the decode batch."""
        r = self.requests.get(request_id)
        if r is None:
            return
        if r.ended:  # the receiver's last word on a transfer that ended here: its pages are no longer written
            self._free_pages(r)
            self._forget(r)
            return
        first, cached = aux.get("first_token_id"), aux.get("cached_tokens", 0)
        problem = None
        if r.layers_received != self.num_layers_expected:
            problem = f"the transfer ended after {r.layers_received} of {self.num_layers_expected} layers"
        elif not (isinstance(first, int) and 0 <= first < self.core.model_config.vocab_size):
            problem = f"first_token_id {first!r} is outside the vocabulary"
        elif not (isinstance(cached, int) and 0 <= cached <= len(r.prompt_ids)):
            problem = f"cached_tokens {cached!r} is outside [0, {len(r.prompt_ids)}]"
        else:
            try:
                out = self.core.add_prefilled(r.request_id, r.prompt_ids, r.params, r.pages, first, cached,
                                              aux.get("rng_state", b""), r.arrival_time, hidden=aux.get("hidden"))
            except (RuntimeError, ValueError) as e:  # e.g. an RNG state of the wrong size (before admission)
                problem = f"the prefilled request was refused: {e}"
        if problem is not None:
            self._free_pages(r)
            self._end(r, Phase.FAILED, KVTransferError("protocol", f"room {r.room}: {problem}"))
            return
        r.pages = []  # the LLMEngine's now
        self._move(r, Phase.RUNNING)
        mark("decode.first_output", request_id)
        self.deliver([(request_id, out)])
        if out.finished:  # (its first token ended it)
            self._end(r, Phase.DONE)

    def kv_failed(self, request_id: str, error: Exception) -> None:
        """RESERVED or RECEIVING -> FAILED: the transfer failed (timeout, the peer gone, a bad layout)."""
        r = self.requests.get(request_id)
        if r is None:
            return
        self._free_pages(r)
        if r.ended:  # the receiver's last word on a transfer that ended here
            self._forget(r)
            return
        self._end(r, Phase.FAILED, error)

    def step(self) -> list[RequestOutput]:
        """One engine step: RUNNING -> DONE for the requests it finished. Its outputs are handed over once, now,
        or under speculation (while rounds follow) from the next round's device wait."""
        outputs = self.core.step()
        for out in outputs:
            if out.finished:
                r = self.requests.get(out.request_id)
                if r is not None and r.phase is Phase.RUNNING:
                    self._end(r, Phase.DONE)
        self.send_unsent()  # held from the round before, if this step had no device wait to send them from
        # With speculation the next round's one device-to-host read is a wait with nothing else to do (no overlap
        # scheduling there): handed over from it, the event loop's work for these tokens runs while the GPU
        # verifies, not between two rounds.
        if outputs and self.core.speculator is not None and self.has_work:
            self._unsent = outputs
        elif outputs:
            self.deliver([(out.request_id, out) for out in outputs])
        return outputs

    def abort(self, request_id: str) -> bool:
        """A live request -> CANCELLED (the router let go); False when there is none by that id."""
        r = self.requests.get(request_id)
        if r is None or r.ended:
            return False
        self._stop(r)
        self._end(r, Phase.CANCELLED)
        return True

    def fail_all(self, error: BaseException) -> None:
        """Every live request -> FAILED with `error` (a step failed: the engine's state for them is not to be
        trusted)."""
        self.send_unsent()  # (tokens of the round before, emitted before the failure)
        for r in list(self.requests.values()):
            if r.ended:
                continue
            try:
                self._stop(r)
            except Exception:  # the engine may be in a bad state: still fail the request
                log.exception("request %s: releasing it after a failed step failed", r.request_id)
            self._end(r, Phase.FAILED, error)

    # ---- StepHooks ---------------------------------------------------------------------------------------------------
    def before_device_wait(self) -> None:
        self.send_unsent()

    def send_unsent(self) -> None:
        """Hand over the outputs held back (the loop calls it when idle or holding a step back too)."""
        if self._unsent:
            outputs, self._unsent = self._unsent, []
            self.deliver([(out.request_id, out) for out in outputs])

    # ---- helpers -------------------------------------------------------------------------------------------------------
    def _move(self, r: DecodeRequest, phase: Phase) -> None:
        assert phase in NEXT[r.phase], f"request {r.request_id}: {r.phase.value} -> {phase.value}"
        self._count[r.phase] -= 1
        self._count[phase] += 1
        r.phase = phase

    def _end(self, r: DecodeRequest, phase: Phase, error: Optional[BaseException] = None) -> None:
        """-> DONE, CANCELLED or FAILED: the record leaves the table unless its pages are still in transit; a
        failure is delivered to the request's stream."""
        self._move(r, phase)
        r.error = error
        if not r.pages_in_transit:
            self._forget(r)
        if error is not None:
            self.deliver([(r.request_id, error)])
        self.on_end(r)

    def _stop(self, r: DecodeRequest) -> None:
        """Whatever works for a live request stops: its decoding, or its transfer (its pages freed now, or marked
        in transit when the receiver may still be writing them)."""
        if r.phase is Phase.RUNNING:
            self.core.abort(r.request_id)  # frees its pages
        elif self.receiver.cancel(r.request_id):  # still waiting for its KV: nothing writes the pages
            self._free_pages(r)
        else:  # the receiver owes this transfer a callback (maybe still writing its pages): freed then
            r.pages_in_transit = True

    def _free_pages(self, r: DecodeRequest) -> None:
        if r.pages:
            self.pool.allocator.decref(r.pages)
            r.pages = []
        r.pages_in_transit = False

    def _forget(self, r: DecodeRequest) -> None:
        del self.requests[r.request_id]
        self._count[r.phase] -= 1


__all__ = ["DecodeEngine", "DecodeRequest", "Phase"]
