"""The prefill tier's engine: computes prompts (chunked, reusing its prefix cache), samples the first token, and
streams the latent KV of every layer to the decode worker that reserved pages for it.

It runs the single-process engine's own step (`LLMEngine.step`) and plugs into it through `StepHooks`: every prompt
is a request that ends after its first token, and the hooks ship its KV and its aux record.

A request's life here: one `PrefillRecord` each (`PrefillEngine.records`), whose `Phase` only the engine thread
moves, each move one method of the engine (`_computing`, `_park`, `_send`, `_end`):

    add ─> QUEUED ─scheduled─> COMPUTING ─first token─> COMPUTED ─bind─> SENDING ─transfer ended─> DONE
                                   │      (no destination yet)          ^
                                   └──── first token, bound ────────────┘
    abort, or its transfer failing ─> FAILED, from any phase (DONE and FAILED leave `records`)

QUEUED     in the scheduler's waiting queue. A bind only sets its destination.
COMPUTING  its chunks run. The router reserves pages on the decode worker while the prompt computes, so its
           destination (`bind`, from any thread) usually comes now, and for a long prompt in the middle of its final
           forward: the engine thread therefore takes binds up between the layers of a forward as well as between
           steps, and a prompt bound there streams the layers written so far at once and each further one as its
           forward writes it (taken only between steps, every layer would wait for the forward's end). A COMPUTED
           prompt bound there ships after the step.
           Bound prompts stream layer by layer (`layerwise`), except to transports whose copy is a GPU copy of
           microseconds (cuda_ipc: `SendHandle.streams_layers` False), which take every layer of the prompt in one
           `send_layers` after the forward: one gather and one announcement per prompt, not per layer. The NextN/MTP
           layer's KV follows once the first token is known (its last position needs that token).
COMPUTED   its first token came before its destination: its pages stay held (a reference) and its aux record kept
           until the bind ships them.
SENDING    its KV and aux record are the transport's; `poll_transfers` (between steps, and while idle) reads how the
           transfer ended. Its answer (`PrefillResult`) went out already: at its sampling (`on_first_tokens`) or at
           the end of the step that sent it.
"""

from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from pdserve.common.blocks import leading_block_hashes
from pdserve.common.trace import mark
from pdserve.common.values import TokenLogprob
from pdserve.engine import LLMEngine, StepHooks
from pdserve.kv_cache import token_slots
from pdserve.kv_transfer import KVSender, KVTransferError, SendHandle, TransferState, TransferStats
from pdserve.request import Request
from pdserve.sampling import SamplingParams
from pdserve.serving.grpc_shell import exhausted


# Why a job for a speculating decode worker is refused by a prefill worker that computes no MTP-layer KV.
MTP_KV_NOT_COMPUTED = ("the decode worker speculates and needs the NextN/MTP layer's KV, which this prefill worker "
                       "does not compute: start it with the decode worker's --speculative-algorithm")

# How long the engine thread waits for a transfer's outcome once its handle says it ended (only for the transport's
# threads to finish recording it).
ENDED_WAIT_S = 1.0


class Phase(enum.Enum):
    QUEUED = "queued"
    COMPUTING = "computing"
    COMPUTED = "computed"  # waiting for its destination
    SENDING = "sending"
    DONE = "done"
    FAILED = "failed"


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    answer: Any = None  # where the worker sends its PrefillResult (opaque here: the worker's, read on its thread)


@dataclass
class PrefillResult:
    """A prompt's answer: its first token, sampled."""
    request_id: str
    first_token_id: int
    cached_tokens: int
    ttft_s: float
    first_token_logprob: Optional[TokenLogprob] = None  # with params.logprobs
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # with params.prompt_logprobs (first: None)


@dataclass(eq=False)
class PrefillRecord:
    """One request's state in this tier (engine thread only)."""
    job: PrefillJob
    phase: Phase = Phase.QUEUED
    handle: Optional[SendHandle] = None  # its destination's room, once bound
    ships_mtp: bool = False  # the destination wants the NextN/MTP layer's KV too (its decode worker speculates)
    layers_sent: int = 0  # main layers handed to the handle while COMPUTING
    slots: Optional[torch.Tensor] = None  # (prompt tokens,) on the pool's device, from its final step until it sends
    pages: list[int] = field(default_factory=list)  # COMPUTED: the pages it holds a reference to
    aux: Optional[dict] = None  # COMPUTED: the aux record its bind ships
    result: Optional[PrefillResult] = None  # COMPUTED: its answer, returned when its bind ships it
    answered: bool = False  # its answer went out at its sampling (on_first_tokens)

    @property
    def request_id(self) -> str:
        return self.job.request_id


# How a transfer ended: the transport's stats, or its error.
TransferEnd = Union[TransferStats, KVTransferError]


class PrefillEngine(StepHooks):
    """Prompts through an LLMEngine's step; each request ends after its first token, its KV shipped."""

    def __init__(self, core: LLMEngine, sender: KVSender,
                 on_blocks: Optional[Callable[[list[bytes]], None]] = None, max_queued: int = 256,
                 layerwise: bool = True,
                 on_first_tokens: Optional[Callable[[list[PrefillResult]], None]] = None):
        """on_first_tokens(results): told once per step, on the engine thread, the answers of the bound prompts
        without logprobs as soon as their first tokens are sampled, before their KV is handed over (the router sends
        those tokens to the clients at once rather than after the rest of the step and the hand-over); `step` then
        leaves them out. Without it, or for the other prompts, answers come from `step` and `take_binds`."""
        self.core, self.sender = core, sender
        self.on_first_tokens = on_first_tokens
        self.layerwise = layerwise
        self.max_queued = max_queued  # prompts waiting for compute; a bounded queue answers "full" at once
        self.pool, self.scheduler = core.pool, core.scheduler
        self.num_main_layers = core.model_config.num_hidden_layers
        # The MTP layer's prompt KV is what a speculating decode worker drafts from, and costs the prompt pass a
        # whole MoE layer more: computed for every prompt when this worker runs with --speculative-algorithm (as
        # `pdserve up` starts both tiers), never otherwise, so every page this worker caches has it or none does.
        # Per request it is shipped only to decode workers that speculate (PrefillRecord.ships_mtp).
        self.computes_mtp_kv = core.model.has_mtp_weights and core.speculator is not None
        self._num_mtp_layers = core.model_config.num_nextn_predict_layers if self.computes_mtp_kv else 0
        self.on_blocks = on_blocks  # told the block hashes this worker now holds (ownership publishing)
        self.records: dict[str, PrefillRecord] = {}  # every request not DONE or FAILED
        self._binds: queue.SimpleQueue = queue.SimpleQueue()  # (request_id, handle, ships_mtp) from any thread
        core.hooks = self

    def num_layers_for(self, ships_mtp: bool) -> int:
        """Layers a destination's room carries: the main model's, then the MTP layer's when it ships them."""
        return self.num_main_layers + (self._num_mtp_layers if ships_mtp else 0)

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

    @property
    def num_sending(self) -> int:
        return sum(r.phase is Phase.SENDING for r in self.records.values())

    # ---- the engine thread's commands ------------------------------------------------------------------------------
    def add(self, job: PrefillJob) -> None:
        """A new request, QUEUED; its destination comes with `bind`."""
        rid = job.request_id
        old = self.records.get(rid)
        if old is not None and old.phase is not Phase.SENDING:
            raise ValueError(f"request_id {rid!r} is already being prefilled")
        if len(self.scheduler.waiting) >= self.max_queued:
            raise exhausted(f"this prefill worker's queue is full ({self.max_queued} prompts waiting, "
                            "--max-queued-requests); retry later or add prefill workers")
        p = job.params
        # The first token is drawn exactly as the single-process engine would draw it; the generator state then
        # travels with the KV so decode continues the same random stream.
        first_only = SamplingParams(max_new_tokens=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                    seed=p.seed, ignore_eos=True, logprobs=p.logprobs,
                                    prompt_logprobs=p.prompt_logprobs)
        self.core.add_request(job.prompt_ids, first_only, rid, arrival_time=job.arrival_time, detokenize=False)
        mark("prefill.queued", rid)
        # (An id reused while its previous request's transfer is still SENDING: that transfer ends in the transport
        # unwatched.)
        self.records[rid] = PrefillRecord(job)

    def bind(self, request_id: str, handle: SendHandle, ships_mtp: bool) -> None:
        """Any thread: the destination of a request (checked with `check_destination`). Taken up by the engine
        thread at its next step (between the layers of a forward too) or `take_binds`; a request gone by then
        (aborted) has the handle aborted."""
        self._binds.put((request_id, handle, ships_mtp))

    def take_binds(self) -> list[PrefillResult]:
        """Engine thread, between steps: the binds that came; the answers of the COMPUTED prompts they shipped."""
        self._bind_arrived()
        shipped = [r for r in self.records.values() if r.phase is Phase.COMPUTED and r.handle is not None]
        for rec in shipped:
            self._ship_computed(rec)
        return [rec.result for rec in shipped]

    def _bind_arrived(self) -> None:
        """The binds that came, each to its request (in whatever phase; a COMPUTED one ships in `take_binds`)."""
        while True:
            try:
                request_id, handle, ships_mtp = self._binds.get_nowait()
            except queue.Empty:
                return
            rec = self.records.get(request_id)
            if rec is None or rec.handle is not None:  # aborted meanwhile (a second bind is refused before this)
                handle.abort()
                continue
            rec.handle, rec.ships_mtp = handle, ships_mtp

    def abort(self, request_id: str) -> bool:
        """Drops the request wherever it is (its transfer too); False for one not known."""
        rec = self.records.get(request_id)
        if rec is None:
            return False
        if rec.phase is Phase.COMPUTED:
            self.pool.allocator.decref(rec.pages)
        elif rec.phase in (Phase.QUEUED, Phase.COMPUTING):
            self.core.abort(request_id)
        if rec.handle is not None:
            rec.handle.abort()
        self._end(rec, Phase.FAILED)
        return True

    def step(self) -> list[PrefillResult]:
        """The answers of prompts whose KV went to their destination (this step's, and COMPUTED ones bound since)
        that were not told at their sampling."""
        results = self.take_binds()
        for out in self.core.step():  # the hooks below sent (or parked) each finished prompt's KV and aux record
            assert out.finished, "a prefill request ends with its first token"
            rec = self.records[out.request_id]
            if rec.answered:
                continue
            result = PrefillResult(out.request_id, out.output_ids[0], out.cached_tokens,
                                   time.monotonic() - rec.job.arrival_time,
                                   out.logprobs[0] if out.logprobs else None, out.prompt_logprobs)
            if rec.phase is Phase.COMPUTED:  # its bind ships it, and returns this
                rec.result = result
            else:
                results.append(result)
        for req in self.scheduler.running:  # prompts with chunks still to come
            rec = self.records.get(req.request_id)
            if rec is not None and rec.phase is Phase.QUEUED:
                self._computing(rec)
        return results

    def poll_transfers(self, on_end: Optional[Callable[[PrefillRecord, TransferEnd], None]] = None
                       ) -> list[tuple[PrefillRecord, TransferEnd]]:
        """Engine thread: the SENDING requests whose transfer ended since (DONE or FAILED now), and how. `on_end`
        sees each one while it is still SENDING, so whoever waits for no request to be sending (`num_sending`)
        also finds what `on_end` did (the worker's counts) done."""
        ended = []
        for rec in [r for r in self.records.values() if r.phase is Phase.SENDING]:
            if rec.handle.poll() not in (TransferState.DONE, TransferState.FAILED):
                continue
            try:
                outcome: TransferEnd = rec.handle.wait(ENDED_WAIT_S)
            except KVTransferError as e:
                outcome = e
            if on_end is not None:
                on_end(rec, outcome)
            self._end(rec, Phase.FAILED if isinstance(outcome, KVTransferError) else Phase.DONE)
            ended.append((rec, outcome))
        return ended

    # ---- phase moves ---------------------------------------------------------------------------------------------
    def _computing(self, rec: PrefillRecord) -> None:
        assert rec.phase is Phase.QUEUED, rec.phase
        rec.phase = Phase.COMPUTING

    def _park(self, rec: PrefillRecord, req: Request, aux: dict) -> None:
        """COMPUTING -> COMPUTED: its pages held past the request's end (this step) until its bind ships them."""
        assert rec.phase is Phase.COMPUTING and rec.handle is None, rec.phase
        self.pool.allocator.incref(req.pages)
        rec.pages, rec.aux, rec.phase = list(req.pages), aux, Phase.COMPUTED

    def _send(self, rec: PrefillRecord, aux: dict) -> None:
        """COMPUTING or COMPUTED -> SENDING: every layer handed over; the aux record closes the room."""
        assert rec.phase in (Phase.COMPUTING, Phase.COMPUTED) and rec.handle is not None, rec.phase
        mark("prefill.handed_over", rec.request_id)  # (before: the confirmation may come back first)
        rec.handle.finish(aux)
        rec.slots, rec.aux, rec.phase = None, None, Phase.SENDING

    def _end(self, rec: PrefillRecord, phase: Phase) -> None:
        assert phase in (Phase.DONE, Phase.FAILED)
        rec.phase = phase
        if self.records.get(rec.request_id) is rec:
            del self.records[rec.request_id]

    def _ship_computed(self, rec: PrefillRecord) -> None:
        main = self.num_main_layers
        rec.handle.send_layers(0, self.pool.kv[:main], rec.slots)
        if rec.ships_mtp:
            rec.handle.send_layers(main, self.pool.kv[main:main + self._num_mtp_layers], rec.slots)
        self._send(rec, rec.aux)
        self.pool.allocator.decref(rec.pages)  # the rows are the transport's now (it gathered them)
        rec.pages = []

    # ---- StepHooks: called inside LLMEngine.step -------------------------------------------------------------------
    def on_layer_done(self, prompts: list[Request], layer: int) -> None:
        if layer == 0:
            for req in prompts:
                mark("prefill.layer0_done", req.request_id)
                rec = self.records[req.request_id]
                if rec.phase is Phase.QUEUED:  # its only chunk
                    self._computing(rec)
        self._bind_arrived()  # (in the middle of a forward: see COMPUTING in the module's docstring)
        if not self.layerwise:
            return
        for req in prompts:
            rec = self.records[req.request_id]
            if rec.handle is not None and rec.handle.streams_layers:
                # Every layer computed so far (more than this one where the bind came in the middle of the forward).
                # The transport gathers the rows once, into memory it owns, so the pool may move on at once.
                rec.handle.send_layers(rec.layers_sent, self.pool.kv[rec.layers_sent:layer + 1],
                                       self._slots_of(req, rec))
                rec.layers_sent = layer + 1

    def on_prefilled(self, prompts: list[Request], first_tokens: list[int], hidden: torch.Tensor) -> None:
        for req in prompts:
            mark("prefill.sampled", req.request_id)
        records = [self.records[req.request_id] for req in prompts]
        if self.on_first_tokens is not None:
            now = time.monotonic()
            told = [PrefillResult(req.request_id, tok, req.num_cached_tokens, now - rec.job.arrival_time)
                    for req, rec, tok in zip(prompts, records, first_tokens)
                    if rec.handle is not None and not rec.job.params.wants_logprobs]
            if told:
                for result in told:
                    self.records[result.request_id].answered = True
                self.on_first_tokens(told)
        try:
            self._hand_over(prompts, records, first_tokens, hidden)
        except BaseException:  # the prompts already answered hear of it from their decode worker, at once
            for rec in records:
                if rec.answered:
                    rec.handle.abort()
            raise

    def _hand_over(self, prompts: list[Request], records: list[PrefillRecord], first_tokens: list[int],
                   hidden: torch.Tensor) -> None:
        """The step's prompts' KV and aux records to their transports (SENDING), or held until their bind
        (COMPUTED)."""
        main = self.num_main_layers
        for req, rec in zip(prompts, records):  # every layer not streamed yet, at once
            if rec.handle is not None and rec.layers_sent < main:
                rec.handle.send_layers(rec.layers_sent, self.pool.kv[rec.layers_sent:main], self._slots_of(req, rec))
        # The MTP layer's KV at the last prompt position needs the first token. A prompt not bound yet gets it
        # wherever this worker computes it: whether its destination wants it is not known yet.
        rows = [i for i, rec in enumerate(records)
                if (rec.ships_mtp if rec.handle is not None else self.computes_mtp_kv)]
        if rows:  # (the servicer binds a destination that wants it only where this worker computes the MTP layer)
            self._mtp_kv_at_last_position([prompts[i] for i in rows], [first_tokens[i] for i in rows], hidden[rows])
            for i in rows:
                mark("prefill.mtp_kv_computed", prompts[i].request_id)
                if records[i].handle is not None:
                    records[i].handle.send_layers(main, self.pool.kv[main:main + self._num_mtp_layers],
                                                  self._slots_of(prompts[i], records[i]))
        hidden_host = hidden.detach().to("cpu", torch.float32)  # (prompts, D): one copy for the step's prompts
        for req, rec, tok, h in zip(prompts, records, first_tokens, hidden_host):
            aux = {"first_token_id": tok, "cached_tokens": req.num_cached_tokens, "hidden": h,  # (the sender copies)
                   "rng_state": _rng_state(req.generator)}
            if rec.handle is not None:
                self._send(rec, aux)
            else:
                self._slots_of(req, rec)  # (its bind ships the rows from these slots)
                self._park(rec, req, aux)
        if self.on_blocks is not None:  # after the KV went: the keys the prefix cache made, no hashing again
            ps = self.pool.page_size
            for req in prompts:
                self.on_blocks(leading_block_hashes(req.prompt_ids, ps, req.num_prompt_tokens // ps, req.block_keys))

    def _mtp_kv_at_last_position(self, prompts: list[Request], first_tokens: list[int], hidden: torch.Tensor) -> None:
        """The MTP layer's KV at each prompt's last position (its input there is the first token)."""
        self.core.runner.mtp_decode(prompts, first_tokens, hidden)

    def compute_only(self) -> StepHooks:
        return _ComputeOnly(self) if self.computes_mtp_kv else super().compute_only()

    def _slots_of(self, req: Request, rec: PrefillRecord) -> torch.Tensor:
        """The prompt's slots `(prompt tokens,)` on the pool's device, made once (uploaded without waiting for the
        GPU)."""
        if rec.slots is None:
            rec.slots = self.core.runner.staging.upload(
                token_slots(req.pages, req.num_prompt_tokens, self.pool.page_size))
        return rec.slots


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
