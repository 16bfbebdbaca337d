"""The prefill tier's engine: computes prompts (chunked, reusing its prefix cache), samples the first token, and
streams the latent KV of every layer to the decode worker that reserved pages for it.

It runs the single-process engine's own step (`LLMEngine.step`) and plugs into it through `StepHooks`: every prompt
is a request that ends after its first token, and the hooks ship its KV and its aux record.

Layer-wise streaming: when a step holds a prompt's final chunk, each layer's KV rows for the whole prompt are
handed to the sender as soon as that layer's forward has written them, so the transfer overlaps the remaining
layers (`layerwise=False` sends them all after the forward instead, to compare). Transports whose copy is a GPU copy
of microseconds (cuda_ipc: `SendHandle.streams_layers` False) take every layer of the prompt in one `send_layers`
after the forward instead: one gather and one announcement per prompt, not per layer. The NextN/MTP layer's KV
follows once the first token is known (its last position needs that token).

A job may come without its destination (`add(job, None)`): the router reserves pages on the decode worker while the
prompt is computed, and `bind` brings the destination later, from any thread. The engine thread takes binds up between
steps and between the layers of a step (a streaming handle then gets the layers already computed at once); a prompt
computed before its bind is parked: its pages stay held and its aux record kept until the bind ships them.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from pdserve.common.blocks import leading_block_hashes
from pdserve.common.trace import mark
from pdserve.common.values import TokenLogprob
from pdserve.engine import LLMEngine, StepHooks
from pdserve.kv_cache import token_slots
from pdserve.kv_transfer import KVSender, SendHandle
from pdserve.request import Request
from pdserve.sampling import SamplingParams
from pdserve.serving.grpc_shell import exhausted


# Why a job for a speculating decode worker is refused by a prefill worker that computes no MTP-layer KV.
MTP_KV_NOT_COMPUTED = ("the decode worker speculates and needs the NextN/MTP layer's KV, which this prefill worker "
                       "does not compute: start it with the decode worker's --speculative-algorithm")


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    dst_pages: list[int]  # the decode worker's reserved pages (the prompt must fit them); [] until bound
    arrival_time: float = field(default_factory=time.monotonic)
    ships_mtp: bool = True  # send the NextN/MTP layer's KV too (False: the decode worker does not speculate)


@dataclass
class PrefillResult:
    request_id: str
    first_token_id: int
    cached_tokens: int
    handle: SendHandle  # wait() for the transfer's completion off the engine thread
    ttft_s: float
    first_token_logprob: Optional[TokenLogprob] = None  # with params.logprobs
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # with params.prompt_logprobs (first: None)


@dataclass
class _Parked:
    """A prompt computed before its destination was known: its pages held (a reference), its aux record kept."""
    pages: list[int]
    slots: torch.Tensor  # (prompt tokens,) on the pool's device
    aux: dict
    result: Optional[PrefillResult] = None  # set at the end of the step that computed it


class PrefillEngine(StepHooks):
    """Prompts through an LLMEngine's step; each request ends after its first token, its KV shipped."""

    def __init__(self, core: LLMEngine, sender: KVSender,
                 on_blocks: Optional[Callable[[list[bytes]], None]] = None, max_queued: int = 256,
                 layerwise: bool = True,
                 on_first_tokens: Optional[Callable[[list["PrefillResult"]], None]] = None):
        """on_first_tokens(results): told once per step, on the engine thread, the results of the bound prompts
        without logprobs as soon as their first tokens are sampled, before their KV is handed over (the router sends
        those tokens to the clients at once rather than after the rest of the step and the hand-over); `step` then
        leaves them out. Without it, or for the other prompts, results come from `step`."""
        self.core, self.sender = core, sender
        self.on_first_tokens = on_first_tokens
        self.layerwise = layerwise
        self.max_queued = max_queued  # prompts waiting for compute; a bounded queue answers "full" at once
        self.pool, self.scheduler = core.pool, core.scheduler
        self.num_main_layers = core.model_config.num_hidden_layers
        # The MTP layer's prompt KV is what a speculating decode worker drafts from, and costs the prompt pass a
        # whole MoE layer more: computed for every prompt when this worker runs with --speculative-algorithm (as
        # `pdserve up` starts both tiers), never otherwise, so every page this worker caches has it or none does.
        # Per request it is shipped only to decode workers that speculate (PrefillJob.ships_mtp).
        self.computes_mtp_kv = core.model.has_mtp_weights and core.speculator is not None
        self._num_mtp_layers = core.model_config.num_nextn_predict_layers if self.computes_mtp_kv else 0
        self.on_blocks = on_blocks  # told the block hashes this worker now holds (ownership publishing)
        self._jobs: dict[str, tuple[PrefillJob, Optional[SendHandle]]] = {}  # handle None: not bound yet
        self._slots: dict[str, torch.Tensor] = {}  # the step's prompts' slots, computed once for all their layers
        self._streamed: dict[str, int] = {}  # the step's streaming prompts: main layers handed over so far
        self._parked: dict[str, _Parked] = {}
        self._binds: queue.SimpleQueue = queue.SimpleQueue()  # (request_id, handle, dst_pages, ships_mtp)
        self._shipped: list[PrefillResult] = []  # parked prompts shipped at their bind, not yet returned
        self._told: set[str] = set()  # prompts whose result went to on_first_tokens this step
        core.hooks = self

    def num_layers_for(self, job: PrefillJob) -> int:
        """Layers the job's room carries: the main model's, then the MTP layer's when it ships them."""
        return self.num_main_layers + (self._num_mtp_layers if job.ships_mtp else 0)

    def check_destination(self, job: PrefillJob, dst_pages: list[int], ships_mtp: bool) -> None:
        """ValueError where a destination cannot take the job (any thread: reads nothing that changes)."""
        if ships_mtp and not self.computes_mtp_kv:
            raise ValueError(MTP_KV_NOT_COMPUTED)
        needed = -(-len(job.prompt_ids) // self.pool.page_size)
        if len(dst_pages) < needed:
            raise ValueError(f"decode reserved {len(dst_pages)} pages but the prompt needs {needed}")

    @property
    def has_work(self) -> bool:
        return self.core.has_unfinished

    def add(self, job: PrefillJob, handle: Optional[SendHandle]) -> None:
        """handle None: the destination comes later (`bind`)."""
        if handle is not None:
            self.check_destination(job, job.dst_pages, job.ships_mtp)
        if job.request_id in self._jobs:
            raise ValueError(f"request_id {job.request_id!r} is already being prefilled")
        if len(self.scheduler.waiting) >= self.max_queued:
            raise exhausted(f"this prefill worker's queue is full ({self.max_queued} prompts waiting, "
                            "--max-queued-requests); retry later or add prefill workers")
        p = job.params
        # The first token is drawn exactly as the single-process engine would draw it; the generator state then
        # travels with the KV so decode continues the same random stream.
        first_only = SamplingParams(max_new_tokens=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                    seed=p.seed, ignore_eos=True, logprobs=p.logprobs,
                                    prompt_logprobs=p.prompt_logprobs)
        self.core.add_request(job.prompt_ids, first_only, job.request_id, arrival_time=job.arrival_time,
                              detokenize=False)
        mark("prefill.queued", job.request_id)
        self._jobs[job.request_id] = (job, handle)

    def bind(self, request_id: str, handle: SendHandle, dst_pages: list[int], ships_mtp: bool) -> None:
        """Any thread: the destination of a job added without one (checked with `check_destination`). Taken up by
        the engine thread in its next step (between its layers too) or `apply_binds`; a job gone by then (aborted)
        has the handle aborted."""
        self._binds.put((request_id, handle, list(dst_pages), ships_mtp))

    def apply_binds(self) -> list[PrefillResult]:
        """Engine thread, between steps: take the binds up; the results of parked prompts shipped by them."""
        self._take_binds()
        shipped, self._shipped = self._shipped, []
        return shipped

    def abort(self, request_id: str) -> bool:
        entry = self._jobs.pop(request_id, None)
        if entry is None:
            return False
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            self.pool.allocator.decref(parked.pages)
        else:
            self.core.abort(request_id)
        if entry[1] is not None:
            entry[1].abort()
        return True

    def step(self) -> list[PrefillResult]:
        """The results of prompts whose KV went to their destination (this step's, and parked ones bound since)."""
        self._take_binds()
        results = []
        for out in self.core.step():  # the hooks below shipped (or parked) each finished prompt's KV and aux record
            assert out.finished, "a prefill request ends with its first token"
            if out.request_id in self._told:  # its result went out at its sampling
                self._told.discard(out.request_id)
                del self._jobs[out.request_id]
                continue
            job, handle = self._jobs[out.request_id]
            result = PrefillResult(out.request_id, out.output_ids[0], out.cached_tokens, handle,
                                   time.monotonic() - job.arrival_time,
                                   out.logprobs[0] if out.logprobs else None, out.prompt_logprobs)
            if handle is None:  # parked by on_prefilled: its bind ships it
                self._parked[out.request_id].result = result
            else:
                del self._jobs[out.request_id]
                results.append(result)
        shipped, self._shipped = self._shipped, []
        return shipped + results

    def _take_binds(self) -> None:
        while True:
            try:
                request_id, handle, dst_pages, ships_mtp = self._binds.get_nowait()
            except queue.Empty:
                return
            entry = self._jobs.get(request_id)
            if entry is None or entry[1] is not None:  # aborted meanwhile (a second bind is refused before this)
                handle.abort()
                continue
            job = entry[0]
            job.dst_pages, job.ships_mtp = dst_pages, ships_mtp
            self._jobs[request_id] = (job, handle)
            parked = self._parked.pop(request_id, None)
            if parked is not None:
                self._ship_parked(job, handle, parked)

    def _ship_parked(self, job: PrefillJob, handle: SendHandle, parked: _Parked) -> None:
        main = self.num_main_layers
        handle.send_layers(0, self.pool.kv[:main], parked.slots)
        if job.ships_mtp:
            handle.send_layers(main, self.pool.kv[main:main + self._num_mtp_layers], parked.slots)
        mark("prefill.handed_over", job.request_id)
        handle.finish(parked.aux)
        self.pool.allocator.decref(parked.pages)  # the rows are the transport's now (it gathered them)
        del self._jobs[job.request_id]
        parked.result.handle = handle
        self._shipped.append(parked.result)

    # ---- StepHooks: called inside LLMEngine.step -------------------------------------------------------------------
    def on_layer_done(self, prompts: list[Request], layer: int) -> None:
        if layer == 0:
            for req in prompts:
                mark("prefill.layer0_done", req.request_id)
        self._take_binds()  # a bind that came during this forward: its prompt streams from here on
        if not self.layerwise:
            return
        for req in prompts:
            handle = self._jobs[req.request_id][1]
            if handle is not None and handle.streams_layers:
                # Every layer computed so far (more than this one where the bind came in the middle of the forward).
                # The transport gathers the rows once, into memory it owns, so the pool may move on at once.
                first = self._streamed.get(req.request_id, 0)
                handle.send_layers(first, self.pool.kv[first:layer + 1], self._slots_of(req))
                self._streamed[req.request_id] = layer + 1

    def on_prefilled(self, prompts: list[Request], first_tokens: list[int], hidden: torch.Tensor) -> None:
        for req in prompts:
            mark("prefill.sampled", req.request_id)
        jobs = [self._jobs[req.request_id] for req in prompts]
        if self.on_first_tokens is not None:
            now = time.monotonic()
            told = [PrefillResult(req.request_id, tok, req.num_cached_tokens, handle, now - job.arrival_time)
                    for req, (job, handle), tok in zip(prompts, jobs, first_tokens)
                    if handle is not None and not job.params.wants_logprobs]
            if told:
                self._told.update(r.request_id for r in told)
                self.on_first_tokens(told)
        try:
            self._hand_over(prompts, jobs, first_tokens, hidden)
        except BaseException:  # the prompts already answered hear of it from their decode worker, at once
            for req, (_, handle) in zip(prompts, jobs):
                if req.request_id in self._told:
                    handle.abort()
            raise

    def _hand_over(self, prompts: list[Request], jobs: list, first_tokens: list[int], hidden: torch.Tensor) -> None:
        """The step's prompts' KV and aux records to their transports (or parked until their bind)."""
        main = self.num_main_layers
        for req, (_, handle) in zip(prompts, jobs):  # every layer not streamed yet, at once
            first = self._streamed.pop(req.request_id, 0)
            if handle is not None and first < main:
                handle.send_layers(first, self.pool.kv[first:main], self._slots_of(req))
        # The MTP layer's KV at the last prompt position needs the first token. A prompt not bound yet gets it
        # wherever this worker computes it: whether its destination wants it is not known yet.
        rows = [i for i, (job, handle) in enumerate(jobs)
                if (job.ships_mtp if handle is not None else self.computes_mtp_kv)]
        if rows:  # (add() admitted a bound job that ships it only where this worker computes the MTP layer)
            self._mtp_kv_at_last_position([prompts[i] for i in rows], [first_tokens[i] for i in rows], hidden[rows])
            for i in rows:
                mark("prefill.mtp_kv_computed", prompts[i].request_id)
                if jobs[i][1] is not None:
                    jobs[i][1].send_layers(main, self.pool.kv[main:main + self._num_mtp_layers],
                                           self._slots_of(prompts[i]))
        hidden_host = hidden.detach().to("cpu", torch.float32)  # (prompts, D): one copy for the step's prompts
        for req, (_, handle), tok, h in zip(prompts, jobs, first_tokens, hidden_host):
            aux = {"first_token_id": tok, "cached_tokens": req.num_cached_tokens, "hidden": h,  # (the sender copies)
                   "rng_state": _rng_state(req.generator)}
            if handle is not None:
                mark("prefill.handed_over", req.request_id)  # (before: the confirmation may come back first)
                handle.finish(aux)
            else:  # held past the request's end (this step) until its bind ships them
                self.pool.allocator.incref(req.pages)
                self._parked[req.request_id] = _Parked(list(req.pages), self._slots_of(req), aux)
        if self.on_blocks is not None:  # after the KV went: the keys the prefix cache made, no hashing again
            ps = self.pool.page_size
            for req in prompts:
                self.on_blocks(leading_block_hashes(req.prompt_ids, ps, req.num_prompt_tokens // ps, req.block_keys))
        self._slots.clear()

    def _mtp_kv_at_last_position(self, prompts: list[Request], first_tokens: list[int], hidden: torch.Tensor) -> None:
        """The MTP layer's KV at each prompt's last position (its input there is the first token)."""
        self.core.runner.mtp_decode(prompts, first_tokens, hidden)

    def compute_only(self) -> StepHooks:
        return _ComputeOnly(self) if self.computes_mtp_kv else super().compute_only()

    def _slots_of(self, req: Request) -> torch.Tensor:
        """The prompt's slots `(prompt tokens,)` on the pool's device, made once per step (uploaded without
        waiting for the GPU)."""
        slots = self._slots.get(req.request_id)
        if slots is None:
            slots = self._slots[req.request_id] = self.core.runner.staging.upload(
                token_slots(req.pages, req.num_prompt_tokens, self.pool.page_size))
        return slots


class _ComputeOnly(StepHooks):
    """The hand-over's compute without the hand-over: the MTP layer's KV at the last position of every prompt (a
    one-token MTP forward whose attention reads the whole prompt: shapes the warm-up's decode batches never run)."""
    computes_mtp_kv = True

    def __init__(self, engine: PrefillEngine):
        self.engine = engine

    def on_prefilled(self, prompts: list[Request], first_tokens: list[int], hidden: torch.Tensor) -> None:
        self.engine._mtp_kv_at_last_position(prompts, first_tokens, hidden)


def _rng_state(gen: Optional[torch.Generator]) -> bytes:
    return b"" if gen is None else gen.get_state().numpy().tobytes()
