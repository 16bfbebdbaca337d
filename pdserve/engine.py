"""The single-process engine: one obvious loop, schedule() -> execute() -> update().

Every tier of pdserve builds on it; the disaggregated path must reproduce its greedy tokens exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from pdserve.config import ModelConfig, ParallelConfig
from pdserve.cuda_graph import CudaGraphConfig
from pdserve.cuda_streams import make_current
from pdserve.kernels import KernelBackends
from pdserve.kv_cache import CacheConfig, LatentKVPool, PageAllocator, token_slots
from pdserve.model_runner import ModelRunner, build_graph_runners
from pdserve.overlap import LaunchedDecode
from pdserve.prefix_cache import PrefixCache
from pdserve.request import FinishReason, Request
from pdserve.common.stopping import StopChecker
from pdserve.sampling import (
    Sampler, SamplingParams, TokenLogprob, logprob_temperature, make_generator, token_logprobs,
)
from pdserve.scheduler import Scheduler, SchedulerConfig, SpecDecode
from pdserve.spec_decode import NextNSpeculator, SpecObserver, SpeculativeConfig
from pdserve.common.progress import first_line, say
from pdserve.common.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.parallel.driver import Driver
from pdserve.parallel.group import SINGLE, rank_device
from pdserve.parallel.ranks import RankDied, Ranks
from pdserve.weights import load_model, resolve_dtype


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Optional[str]
    dtype: str = "auto"  # auto = the checkpoint's dtype
    device: str = "cpu"
    load_format: str = "auto"  # auto | safetensors | dummy
    attention_backend: str = "torch"
    moe_backend: str = "torch"
    gemm_backend: str = "torch"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefix_chunk_tokens: int = 4096  # cached-prefix tokens decompressed per attention chunk in prefill
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)  # used on CUDA with graph-safe kernels
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # NextN drafting for decode rows
    # Launch decode step N+1 before reading step N's tokens (pdserve.overlap); plain decode steps only.
    overlap_schedule: bool = True
    # Tensor parallelism: this engine is rank 0 of parallel.tp_size ranks (device: rank 0's; see pdserve.parallel).
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


class StepHooks:
    """What a tier plugs into `LLMEngine.step` instead of writing its own step (the prefill worker ships KV here).

    Called on the engine's thread, in this order within a step that completes prompts (runs their final chunk):
    `on_layer_done` after each main-model layer of the forward has written their KV, then `on_prefilled` once their
    first tokens are sampled (before they are appended, so `num_tokens - 1` is still the last prompt position).
    """

    # The MTP layer's prompt KV is computed in every prefill step (speculation does that anyway; a prefill worker
    # also needs it without speculating, to ship it).
    computes_mtp_kv: bool = False

    def on_layer_done(self, prompts: list[Request], layer: int) -> None:
        """Layer `layer` holds the KV of every position of `prompts` (written by this forward or cached)."""

    def on_prefilled(self, prompts: list[Request], first_tokens: list[int], hidden: torch.Tensor) -> None:
        """`prompts` got their first tokens; hidden `(len(prompts), hidden_size)`: the last prompt position's
        hidden state before the final norm (what NextN drafts from)."""

    def before_device_wait(self) -> None:
        """The step has queued its GPU work and is about to wait for it (a speculative round's one device-to-host
        read): host work a tier put off now runs behind the GPU's instead of between two rounds."""

    def compute_only(self) -> "StepHooks":
        """Hooks that compute what these compute for a prompt and ship nothing (the warm-up runs its prompts
        through them: the first real request then finds every kernel the tier launches compiled)."""
        hooks = StepHooks()
        hooks.computes_mtp_kv = self.computes_mtp_kv
        return hooks


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    output_ids: list[int]
    finish_reason: Optional[str]
    prompt_tokens: int
    cached_tokens: int
    # One per new token when the request asked for logprobs (None for a token sampled elsewhere: the decode tier's
    # first token, whose logprob the prefill tier computed).
    logprobs: Optional[list[Optional[TokenLogprob]]] = None
    # With prompt_logprobs, on the request's first output: one per prompt token, None for the first.
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: Optional[Callable[[str], None]] = None,
                 model_config: Optional[ModelConfig] = None, spec_observer: Optional[SpecObserver] = None,
                 hooks: Optional[StepHooks] = None):
        """spec_observer is told the accepted lengths and draft/verify times of every speculative round; hooks
        (settable later as `engine.hooks`) are what a tier runs inside each step.

        With config.parallel.tp_size > 1 it starts the other tensor-parallel ranks (stopped by close(), or at exit)."""
        if config.parallel.tp_size > 1:  # rank 0's device, spelled out (the others are counted from it)
            config = dataclasses.replace(config, device=rank_device(config.device, 0))
        self.config = config
        make_current(config.device)  # the loading, graph capture and warm-up below launch on it
        self.model_config = model_config or ModelConfig.from_model_dir(config.model_dir)
        cfg = self.model_config
        config.parallel.check_model(cfg)
        dtype = resolve_dtype(config.dtype, cfg)
        kernels = KernelBackends.create(config.attention_backend, config.moe_backend, config.gemm_backend)
        sched = config.scheduler
        if sched.max_model_len > cfg.max_position_embeddings:
            sched = dataclasses.replace(sched, max_model_len=cfg.max_position_embeddings)
        self.ranks: Optional[Ranks] = None
        if config.parallel.tp_size > 1:
            self.ranks = Ranks(config, cfg, config.device, sched.max_model_len, progress or say)
        try:
            self._build(kernels, dtype, sched, progress)
        except BaseException:
            self.close()
            raise
        self.spec_observer = spec_observer
        self.hooks = hooks or StepHooks()
        if self.speculator is not None:  # (through self.hooks: a tier sets its hooks after construction)
            self.speculator.before_read = lambda: self.hooks.before_device_wait()
        self.sampler = Sampler()
        self.eos_token_ids = set(cfg.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._stops: dict[str, StopChecker] = {}
        self._prompt_logprobs: dict[str, dict[int, TokenLogprob]] = {}  # request id -> prompt position -> logprob
        self._launched: Optional[LaunchedDecode] = None  # overlap scheduling: the decode step not yet read
        self.num_overlapped_steps = 0

    def _build(self, kernels: KernelBackends, dtype: torch.dtype, sched: SchedulerConfig,
               progress: Optional[Callable[[str], None]]) -> None:
        """The model (this rank's shards), tokenizer, KV pool, scheduler, CUDA graphs and runner."""
        config, cfg = self.config, self.model_config
        tp = self.ranks.group if self.ranks is not None else SINGLE
        self.model = load_model(config.model_dir, cfg, dtype, kernels, config.load_format, config.device,
                                config.prefix_chunk_tokens, progress, tp=tp, ep=config.parallel.ep_size > 1,
                                dp_attention=config.parallel.dp_attention)
        if config.speculative.enabled and not self.model.has_mtp_weights:
            raise ValueError(f"--speculative-algorithm {config.speculative.algorithm} drafts with the NextN/MTP layer, "
                             f"but the checkpoint {config.model_dir} has no MTP weights (num_nextn_predict_layers="
                             f"{cfg.num_nextn_predict_layers}, tensors model.layers.{cfg.num_hidden_layers}.*): "
                             "drop the flag or use a checkpoint that has them")
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir) if config.model_dir else None
        if self.tokenizer is not None and self.tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} tokens but the model only "
                             f"{cfg.vocab_size}: the model directory mixes two models")
        self.pool = LatentKVPool(cfg.num_kv_layers, cfg.kv_cache_dim, config.cache, dtype, config.device)
        self.prefix_cache = PrefixCache(self.pool.allocator, config.cache.page_size)
        # DP attention: ranks 1.. hold pools of the same size, whose pages rank 0's scheduler hands out
        dp_caches = [PrefixCache(PageAllocator(config.cache.num_pages), config.cache.page_size)
                     for _ in range(1, config.parallel.dp_size)]
        spec = config.speculative
        self.scheduler = Scheduler(sched, config.cache, self.prefix_cache, spec.num_steps if spec.enabled else 0,
                                   dp_caches)
        graphs = build_graph_runners(self.model, self.pool, kernels, config.cuda_graph, config.device,
                                     spec.num_steps if spec.enabled else 0, sched.max_model_len, progress,
                                     dp=tp if config.parallel.dp_attention else None)
        driver = Driver(self.model, self.ranks, config.parallel.dp_size) if self.ranks is not None else None
        self.runner = ModelRunner(self.model, self.pool, config.device, *graphs, driver=driver)
        if self.ranks is not None:
            self.ranks.first_release(self.runner.release_graphs)
        self.speculator = NextNSpeculator(self.runner, spec) if spec.enabled else None
        if self.ranks is not None:
            self.ranks.wait_ready()

    def cannot_go_on(self, error: BaseException) -> Optional[str]:
        """Why this engine can run no step after `error` raised from one (None: it can): a tensor-parallel rank died
        or the ranks are out of step (pdserve.parallel.ranks), or the device is broken: a CUDA error such as an
        illegal memory access leaves the context unusable, which a synchronize then reports."""
        if isinstance(error, RankDied):  # (RanksOutOfStep included)
            return first_line(error)
        device = torch.device(self.config.device)
        if device.type != "cuda":
            return None
        try:
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 (whatever it raises, the device cannot run the next step)
            return f"its GPU ({device}) can no longer run steps: {first_line(e)}"
        return None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (nothing to do in a single process; without close() they
        stop at exit)."""
        if self.ranks is not None:
            self.ranks.close()

    # ---- requests ----------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: Optional[str] = None,
                    arrival_time: Optional[float] = None, detokenize: bool = True) -> str:
        """detokenize=False: outputs carry no text (a prefill worker's first token is only shipped)."""
        ids = self.encode(prompt)
        self.check_logprobs(params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = Request(request_id, ids, params, arrival_time=arrival_time or time.monotonic(),
                      generator=make_generator(params.seed, self.config.device))
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer and detokenize else None
        stop = StopChecker(params, () if params.ignore_eos else self.eos_token_ids, detok)
        self.scheduler.add(req)
        self._requests[request_id], self._stops[request_id] = req, stop
        return request_id

    def add_prefilled(self, request_id: str, prompt_ids: list[int], params: SamplingParams, pages: list[int],
                      first_token: int, cached_tokens: int, rng_state: bytes = b"",
                      arrival_time: Optional[float] = None, hidden: Optional[torch.Tensor] = None) -> RequestOutput:
        """Join a request whose prompt KV is already in `pages` (computed elsewhere: the decode tier) and whose
        first token was sampled there; it continues exactly as if this engine had computed it.

        hidden (hidden_size,): the target's hidden state at the last prompt position (before the final norm), which
        speculative decoding's first draft step starts from; without it the first round only verifies.
        """
        if self.speculator is None:
            hidden = None  # only speculation uses it
        elif hidden is not None and tuple(hidden.shape) != (self.model_config.hidden_size,):
            raise ValueError(f"hidden has shape {tuple(hidden.shape)}; this model expects "
                             f"({self.model_config.hidden_size},)")
        req = Request(request_id, list(prompt_ids), params, arrival_time=arrival_time or time.monotonic(),
                      generator=make_generator(params.seed, self.config.device), pages=list(pages),
                      num_computed_tokens=len(prompt_ids), num_cached_tokens=cached_tokens)
        if rng_state and req.generator is not None:
            req.generator.set_state(torch.frombuffer(bytearray(rng_state), dtype=torch.uint8))
        # (nothing below refuses the request: from here its pages are the engine's, wherever they end up)
        if self.config.parallel.dp_attention:
            self._place_prefilled(req)
        elif self.runner.driver is not None:  # under TP every rank attends over its own copy of the prompt's KV
            self.runner.driver.share_kv(self.pool.kv, token_slots(pages, len(prompt_ids), self.pool.page_size))
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids) if self.tokenizer else None
        self._stops[request_id] = StopChecker(params, () if params.ignore_eos else self.eos_token_ids, detok)
        self._requests[request_id] = req
        self.scheduler.admit_computed(req)
        out = self._append(req, [first_token])
        if self.speculator is not None and hidden is not None and not out.finished:
            self.speculator.adopt(req, hidden.to(self.pool.dtype))
        return out

    def _place_prefilled(self, req: Request) -> None:
        """DP attention: a transfer lands in rank 0's pool (the one the transports know); the request runs on the
        least loaded rank (pdserve.scheduler), so its KV moves there, into pages of that rank's pool, and the landing
        pages are freed. It stays on rank 0 when that rank is the least loaded or the other has no pages free."""
        rank = self.scheduler.least_loaded_rank()
        if rank == 0:
            return
        dst = self.scheduler.caches[rank].alloc_with_eviction(len(req.pages))
        if dst is None:
            return
        n, ps = req.num_computed_tokens, self.pool.page_size
        # NOTE: one more hop over the ranks' link per request (a prompt's latent KV, all layers: a fraction of the
        # transfer that brought it), so that the transports address one pool per worker.
        self.runner.driver.move_kv(self.pool.kv, token_slots(req.pages, n, ps), token_slots(dst, n, ps), 0, rank)
        self.scheduler.caches[0].allocator.decref(req.pages)
        req.pages, req.dp_rank = dst, rank

    def check_logprobs(self, params: SamplingParams) -> None:
        """NOTE: speculative rows emit several verified tokens per step without a per-token distribution here."""
        if self.speculator is not None and params.logprobs is not None:
            raise ValueError("logprobs: not available on a worker running speculative decoding "
                             "(--speculative-algorithm); send the request without logprobs")

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one token")
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            try:  # (a loop in C: a prefill worker's every prompt passes here; faster than [int(t) for t in prompt])
                ids = list(map(operator.index, prompt))
            except TypeError:
                raise ValueError("token ids must be integers") from None
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise ValueError(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        return ids

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)
        self._stops.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        if self._launched is not None and not self.scheduler.has_unfinished:
            self._read_launched()  # it computed for aborted requests only: its pages go back now, not at a next step
        return req is not None

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._launched is not None

    # ---- the loop ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. With overlap scheduling a plain decode step returns the outputs of the step before it
        (its own are read by the next call); any other step reads the launched one first, then runs in order."""
        if self.config.overlap_schedule and self.speculator is None and self.scheduler.next_step_decodes_only():
            return self._overlapped_decode_step()
        outputs = self._read_launched()
        return outputs + self._step_in_order()

    def _overlapped_decode_step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        assert not (scheduled.prefill or scheduled.preempted or scheduled.spec_decode), "not a plain decode step"
        launched = None
        if scheduled.decode:  # empty when every running request's newest token is its last
            previous = self._launched
            resolve = previous.resolver_for(scheduled.decode) if previous else None
            forward = self.runner.execute(scheduled, resolve_inputs=resolve)
            tokens = self.sampler.sample(forward.logits, [r.params for r in forward.requests],
                                         [r.generator for r in forward.requests])  # stays on the device
            launched = LaunchedDecode.launch(forward.requests, tokens, [c.allocator for c in self.scheduler.caches],
                                             self.pool.page_size)
            self.scheduler.update(scheduled)
            self.num_overlapped_steps += 1
        outputs = self._read_launched()  # the previous step, while the GPU runs this one
        self._launched = launched
        return outputs

    def _read_launched(self) -> list[RequestOutput]:
        launched, self._launched = self._launched, None
        if launched is None:
            return []
        outputs = []
        for req, at, token in zip(launched.requests, launched.output_index, launched.read()):
            if self._requests.get(req.request_id) is not req:
                continue  # aborted, or finished on its previous token: this row's token is dropped
            req.output_ids[at] = token
            update = self._stops[req.request_id].update([token])
            reason = update.finish_reason
            if reason is None and req.num_prompt_tokens + at + 1 >= self.scheduler.config.max_model_len:
                reason = FinishReason.LENGTH.value
            if reason is not None:
                # A later launched row computed this token's KV (right: its input was this token) and appended a
                # placeholder after it, which goes.
                del req.output_ids[at + 1:]
                self._finish(req, reason)
            outputs.append(RequestOutput(req.request_id, [token], update.text, reason is not None,
                                         req.output_ids[: at + 1], reason, req.num_prompt_tokens,
                                         req.num_cached_tokens))
        return outputs

    def _step_in_order(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        hooks = self.hooks
        prompts = [c.request for c in scheduled.prefill if c.samples]  # prompts this step completes
        layer_done = (lambda layer: hooks.on_layer_done(prompts, layer)) if prompts else None
        forward = self.runner.execute(scheduled, layer_done=layer_done)
        if scheduled.prefill and (self.speculator is not None or hooks.computes_mtp_kv):
            self.runner.mtp_extend(scheduled.prefill, forward.extend_hidden)  # the MTP layer's prompt KV
        tokens = []
        if forward.requests:  # a step may only advance prompt chunks
            tokens = self.sampler.sample(forward.logits, [r.params for r in forward.requests],
                                         [r.generator for r in forward.requests]).tolist()
        logprobs = self._token_logprobs(forward.requests, forward.logits, tokens)
        if scheduled.prefill and forward.extend_hidden is not None:
            self._collect_prompt_logprobs(scheduled.prefill, forward.extend_hidden)
        if prompts:
            completed = set(map(id, prompts))
            rows = [i for i, r in enumerate(forward.requests) if id(r) in completed]  # prompts, in sampling order
            hooks.on_prefilled([forward.requests[i] for i in rows], [tokens[i] for i in rows], forward.hidden[rows])
        verified, stats = [], None
        if scheduled.spec_decode:
            verified, stats = self.speculator.propose_and_verify(scheduled.spec_decode)
            self.speculator.extend(verified, stats)  # queued on the device before the host's bookkeeping below
        self.scheduler.update(scheduled)
        outputs = [self._append(req, [tok], logprobs=None if lp is None else [lp])
                   for req, tok, lp in zip(forward.requests, tokens, logprobs)]
        if self.speculator is not None:
            going_on = [i for i, o in enumerate(outputs) if not o.finished]
            self.speculator.prime([forward.requests[i] for i in going_on], forward.hidden[going_on])
        for v in verified:
            outputs.append(self._append(v.row.request, v.tokens, v.row))
        if verified and self.spec_observer is not None:
            self.spec_observer.on_spec_round(stats)
        return outputs

    # ---- logprobs: computed only for the rows that ask ---------------------------------------------------------
    def _token_logprobs(self, requests: list[Request], logits: torch.Tensor, tokens: list[int]
                        ) -> list[Optional[TokenLogprob]]:
        """Per sampled row: its token's logprob and top alternatives (None where the request did not ask)."""
        out: list[Optional[TokenLogprob]] = [None] * len(tokens)
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return out
        num_top = max(requests[i].params.logprobs for i in rows)
        computed = token_logprobs(logits[rows], [tokens[i] for i in rows],
                                  [logprob_temperature(requests[i].params) for i in rows], num_top)
        for i, lp in zip(rows, computed):
            out[i] = dataclasses.replace(lp, top=lp.top[: requests[i].params.logprobs])
        return out

    def _collect_prompt_logprobs(self, chunks, extend_hidden: torch.Tensor) -> None:
        """For requests with prompt_logprobs: the logprob of prompt token p+1 from the logits at position p, for
        every prompt position this step computed (their prompts skip the prefix cache, so every position is)."""
        offset = 0
        for c in chunks:
            req, start = c.request, offset
            offset += c.num_tokens
            k = req.params.prompt_logprobs
            if k is None or req.output_ids:  # recomputed after a preemption: already reported
                continue
            positions = [p for p in range(c.start, c.start + c.num_tokens) if p + 1 < req.num_prompt_tokens]
            if not positions:
                continue
            rows = torch.tensor([start + p - c.start for p in positions], device=extend_hidden.device)
            logits = self.model.logits(extend_hidden[rows])  # (positions, vocab) fp32
            computed = token_logprobs(logits, [req.prompt_ids[p + 1] for p in positions],
                                      [logprob_temperature(req.params)] * len(positions), k)
            self._prompt_logprobs.setdefault(req.request_id, {}).update(zip(positions, computed))

    def _take_prompt_logprobs(self, req: Request) -> Optional[list[Optional[TokenLogprob]]]:
        if req.params.prompt_logprobs is None or req.output_ids:
            return None
        got = self._prompt_logprobs.pop(req.request_id, {})
        return [None] + [got.get(p) for p in range(req.num_prompt_tokens - 1)]

    def _append(self, req: Request, tokens: list[int], spec_row: Optional[SpecDecode] = None,
                logprobs: Optional[list[Optional[TokenLogprob]]] = None) -> RequestOutput:
        """Append a step's tokens (several from a speculative row), cut after the first that finishes the request.
        logprobs: one per token where the request asked for them."""
        prompt_logprobs = self._take_prompt_logprobs(req)
        update = self._stops[req.request_id].update(tokens)
        tokens = tokens[: update.num_accepted]
        if req.params.logprobs is not None:
            logprobs = (logprobs or [None] * len(tokens))[: len(tokens)]
        else:
            logprobs = None
        req.output_ids.extend(tokens)
        if spec_row is not None:
            self.scheduler.update_speculative(spec_row, len(tokens))
        reason = update.finish_reason
        if reason is None and req.num_tokens >= self.scheduler.config.max_model_len:
            reason = FinishReason.LENGTH.value  # the context is full
        if reason is not None:
            self._finish(req, reason)
        return RequestOutput(req.request_id, tokens, update.text, reason is not None, list(req.output_ids),
                             reason, req.num_prompt_tokens, req.num_cached_tokens, logprobs, prompt_logprobs)

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, FinishReason(reason))
        self._requests.pop(req.request_id)
        self._stops.pop(req.request_id)

    def generate(self, prompts: Iterable[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); returns the final output of each, in order."""
        prompts = list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        texts: dict[str, str] = {i: "" for i in ids}
        logprobs: dict[str, list] = {i: [] for i in ids}
        prompt_logprobs: dict[str, Optional[list]] = {}
        while self.has_unfinished:
            for out in self.step():
                texts[out.request_id] += out.new_text
                logprobs[out.request_id] += out.logprobs or []
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    out.new_text = texts[out.request_id]  # whole text for the caller
                    if out.logprobs is not None:  # and every token's logprobs
                        out.logprobs = logprobs[out.request_id]
                    out.prompt_logprobs = prompt_logprobs.get(out.request_id)
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def kv_pages_in_use_by_requests(self) -> int:
        """Pages held by requests (not by the prefix cache alone), in every DP rank's pool; 0 when idle."""
        return sum(c.allocator.num_used - c.num_cache_only_pages for c in self.scheduler.caches)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of latent KV the worker holds: one pool's under TP (every rank holds the same), one pool per rank
        under DP attention."""
        return self.pool.num_slots * self.config.parallel.dp_size


__all__ = ["LLMEngine", "EngineConfig", "RequestOutput", "StepHooks"]
