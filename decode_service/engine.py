"""The decode tier's engine: reserves pages for requests a prefill worker computes, receives their latent KV into
those pages, and continues them in its continuously batched decode loop (absorbed MLA).

A request has one identity here, its request_id (the transfer's room lives inside kv_transfer).
Request life on this side (each step runs on the engine thread):
  reserve() -> pages held, the request's transfer registered with the receiver (waiting for KV)
  KV layers arrive -> written into the pages (by the transport itself for nccl/gloo);  aux arrives ->
  add_prefilled(): first token streamed, decoding
  finish / abort / cancel / transfer failure -> pages freed (never leaked: every exit path goes through _release;
  an abort whose pages the transport is still writing waits in `cancelling` for the receiver's last callback)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from pdserve.engine import LLMEngine, RequestOutput
from pdserve.serving.grpc_shell import exhausted
from pdserve.kv_transfer import KVTransferError, RequestReceiver
from pdserve.sampling import SamplingParams


@dataclass
class PendingTransfer:
    request_id: str
    room: int  # the transfer's id on the wire, handed to prefill through the router
    prompt_ids: list[int]
    params: SamplingParams
    pages: list[int]
    arrival_time: float = field(default_factory=time.monotonic)
    layers_received: int = 0


class DecodeEngine:
    def __init__(self, core: LLMEngine, receiver: RequestReceiver, num_layers_expected: int,
                 on_output: Callable[[RequestOutput], None],
                 on_failed: Callable[[str, Exception], None], max_queued: int = 256):
        """on_output(output) and on_failed(request_id, error) are called on the engine thread. max_queued: requests
        reserved and still waiting for their KV; a bounded queue answers "full" at once."""
        self.core, self.receiver = core, receiver
        self.max_queued = max_queued
        self.pool = core.pool
        self.num_layers_expected = num_layers_expected
        self.on_output, self.on_failed = on_output, on_failed
        self.pending: dict[str, PendingTransfer] = {}  # request id -> reserved pages waiting for their KV
        self.cancelling: dict[str, PendingTransfer] = {}  # aborted; pages freed at the receiver's last callback

    @property
    def has_work(self) -> bool:
        return self.core.has_unfinished

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> PendingTransfer:
        if request_id in self.pending or request_id in self.cancelling or self.core.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use on this decode worker")
        self.core.encode(prompt_ids)  # vocabulary check
        self.core.check_logprobs(params)
        if params.stop and self.core.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer and this model has no tokenizer.json")
        if len(prompt_ids) + 1 > self.core.scheduler.config.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the limit is "
                             f"{self.core.scheduler.config.max_model_len - 1}")
        if len(self.pending) >= self.max_queued:
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
        t = PendingTransfer(request_id, room, list(prompt_ids), params, pages)
        self.pending[request_id] = t
        return t

    # ---- called (through the engine loop) by the receiver's callbacks -------------------------------------------
    def kv_layer(self, request_id: str, layer: int, slots: torch.Tensor, values: Optional[torch.Tensor]) -> None:
        """values None: the transport already wrote the layer into the pages (nccl, gloo)."""
        t = self.pending.get(request_id)
        if t is None:
            return  # aborted meanwhile
        if values is not None:
            self.pool.kv[layer].index_copy_(0, slots.to(self.pool.kv.device), values.to(self.pool.kv.device,
                                                                                         self.pool.kv.dtype))
        t.layers_received += 1

    def kv_done(self, request_id: str, aux: dict) -> None:
        t = self.pending.pop(request_id, None)
        if t is None:
            self._cancelled(request_id)
            return
        assert t.layers_received == self.num_layers_expected, "receiver reported done before every layer"
        first, cached = aux.get("first_token_id"), aux.get("cached_tokens", 0)
        # The aux record comes from a peer: a bad value fails this request, never the decode batch.
        problem = None
        if not (isinstance(first, int) and 0 <= first < self.core.model_config.vocab_size):
            problem = f"first_token_id {first!r} is outside the vocabulary"
        elif not (isinstance(cached, int) and 0 <= cached <= len(t.prompt_ids)):
            problem = f"cached_tokens {cached!r} is outside [0, {len(t.prompt_ids)}]"
        else:
            try:
                out = self.core.add_prefilled(t.request_id, t.prompt_ids, t.params, t.pages, first, cached,
                                              aux.get("rng_state", b""), t.arrival_time, hidden=aux.get("hidden"))
            except (RuntimeError, ValueError) as e:  # e.g. an RNG state of the wrong size (before admission)
                problem = f"the prefilled request was refused: {e}"
        if problem is not None:
            self._release(t)
            self.on_failed(request_id, KVTransferError("protocol", f"room {t.room}: {problem}"))
            return
        self.on_output(out)

    def kv_failed(self, request_id: str, error: Exception) -> None:
        t = self.pending.pop(request_id, None)
        if t is None:
            self._cancelled(request_id)
            return
        self._release(t)
        self.on_failed(request_id, error)

    # ---- the loop ---------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; its outputs go back to the caller in one list (a first token, produced when a
        request's KV completes, goes through on_output instead)."""
        return self.core.step()

    def abort(self, request_id: str) -> bool:
        t = self.pending.pop(request_id, None)
        if t is None:
            return self.core.abort(request_id)
        if self.receiver.cancel(request_id):  # still waiting for its KV
            self._release(t)
        else:  # the receiver owes this transfer a callback (maybe still writing its pages): free them then
            self.cancelling[request_id] = t
        return True

    def _release(self, t: PendingTransfer) -> None:
        self.pool.allocator.decref(t.pages)
        t.pages = []

    def _cancelled(self, request_id: str) -> None:
        """The receiver's last word on a transfer aborted here: its pages are no longer written, free them."""
        t = self.cancelling.pop(request_id, None)
        if t is not None:
            self._release(t)

    @property
    def num_transferring(self) -> int:
        return len(self.pending) + len(self.cancelling)
