"""Continuous-batching scheduler: decides, each step, which tokens of which requests the model computes.

Pure bookkeeping (no model, no device): it is tested on the CPU by feeding it fake sampled tokens.
Policy per step:
  1. every running request that is decoding gets one token (a new page when it crosses a page boundary; when the
     pool is exhausted the most recently arrived running request is preempted and recomputed later);
  2. the remaining token budget goes to prefill chunks: unfinished prompts first, then waiting requests in arrival
     order, which first reuse their longest cached prefix. A prompt longer than the budget runs in chunks.
With speculative decoding (spec_steps > 0) a decoding request instead gets a verification row of 1 + k tokens
(k drafts, fewer near its length limits or when the budget or the pool is short; speculation never preempts): pages
for those positions are reserved here and the unused tail is returned by update_speculative once the accepted
length is known.
With DP attention (dp_caches: one prefix cache, so one pool, per DP rank) each request is placed on a rank when it
is admitted, the least loaded (fewest running requests, then most free pages), and lives on that rank's pool: its
pages, its prefix matches and the requests it may preempt are that rank's. Each pool is the whole KV budget of its
rank, so the worker holds dp_size pools' worth of tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pdserve.kv_cache import CacheConfig
from pdserve.prefix_cache import PrefixCache
from pdserve.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # tokens computed per step (prefill chunk budget + decode rows)
    max_running_requests: int = 64
    max_model_len: int = 4096  # prompt + output tokens per request
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_running_requests", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")


@dataclass(frozen=True)
class PrefillChunk:
    request: Request
    start: int  # first token index computed (== num_computed_tokens at schedule time)
    num_tokens: int
    samples: bool = False  # the chunk reaches the end of the request's tokens: its last row is sampled

    @classmethod
    def of(cls, request: Request, start: int, num_tokens: int) -> "PrefillChunk":
        # Decided at schedule time: once the sampled token is appended the request has one more token.
        return cls(request, start, num_tokens, start + num_tokens == request.num_tokens)


@dataclass(frozen=True)
class SpecDecode:
    """A speculative decode row: the request's newest token plus num_drafts draft tokens are verified at once."""

    request: Request
    num_drafts: int  # k for this request this step (0 = a plain decode through the speculative path)

    @property
    def num_tokens(self) -> int:
        return 1 + self.num_drafts


@dataclass
class SchedulerOutput:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec_decode: list[SpecDecode] = field(default_factory=list)  # only with speculative decoding (then no decode)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode and not self.spec_decode

    @property
    def num_tokens(self) -> int:
        return (sum(c.num_tokens for c in self.prefill) + len(self.decode)
                + sum(s.num_tokens for s in self.spec_decode))

    def holds(self, req: Request) -> bool:
        """Whether this step already computes something for req (then it must not be preempted)."""
        return (req in self.decode or any(c.request is req for c in self.prefill)
                or any(s.request is req for s in self.spec_decode))


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, prefix_cache: PrefixCache, spec_steps: int = 0,
                 dp_caches: Sequence[PrefixCache] = ()):
        """spec_steps: draft tokens per speculative decode row (0 = no speculative decoding). dp_caches: under DP
        attention the prefix caches (over their pools' allocators) of ranks 1.., prefix_cache being rank 0's."""
        assert spec_steps >= 0
        self.config = config
        self.spec_steps = spec_steps
        self.page_size = cache.page_size
        self.num_pages = cache.num_pages  # of each rank's pool
        self.prefix_cache = prefix_cache
        self.allocator = prefix_cache.allocator
        self.caches: list[PrefixCache] = [prefix_cache, *dp_caches]  # by DP rank
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- requests in and out ------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; the limit is "
                             f"max_model_len - 1 = {self.config.max_model_len - 1}")
        # A request that cannot fit in the whole pool would wait (or preempt itself) forever and block the queue.
        most = min(request.num_prompt_tokens + request.params.max_new_tokens, self.config.max_model_len)
        if -(-most // self.page_size) > self.num_pages:
            raise ValueError(f"the request needs up to {most} tokens of KV but the pool holds "
                             f"{self.num_pages * self.page_size} (num_pages={self.num_pages}, "
                             f"page_size={self.page_size}); shorten it or enlarge the pool")
        self.waiting.append(request)

    def admit_computed(self, request: Request) -> None:
        """Run a request whose prompt KV is already in its pages (the decode tier receives it from prefill)."""
        assert len(request.pages) * self.page_size >= request.num_computed_tokens, "KV beyond its pages"
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def abort(self, request_id: str) -> Optional[Request]:
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._finish(req, FinishReason.ABORT)
                    return req
        return None

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Called by the engine when a running request stops (eos, stop string, length)."""
        self.running.remove(request)
        self._finish(request, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self._publish(req)  # keep what was computed for later prompts that share it
        self.caches[req.dp_rank].allocator.decref(req.pages)
        req.pages = []
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for req in sorted((r for r in self.running if r.is_decoding), key=lambda r: r.arrival_time):
            if req.status is not RequestStatus.RUNNING or budget == 0:
                continue  # preempted while making room for an earlier request
            if self.reached_length_limit(req):
                continue  # its newest token, not yet read by the host (overlap scheduling), is its last
            if self.spec_steps:
                k = self._num_drafts(req, budget)
                # Draft positions only take free (or evictable) pages; when those run short the row shrinks to a
                # plain decode, which may preempt as usual.
                if not (k and self._reserve_free(req, req.num_tokens + k)):
                    k = 0
                    if not self._reserve(req, req.num_tokens, out):
                        continue
                out.spec_decode.append(SpecDecode(req, k))
                budget -= 1 + k
            elif self._reserve(req, req.num_tokens, out):
                out.decode.append(req)
                budget -= 1
        # Prompts already started continue first, so a long prompt is not starved by newcomers.
        for req in [r for r in self.running if not r.is_decoding]:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted above
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._reserve(req, req.num_computed_tokens + n, out):
                out.prefill.append(PrefillChunk.of(req, req.num_computed_tokens, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            req.dp_rank = self.least_loaded_rank()
            cache = self.caches[req.dp_rank]
            # A prompt whose every position's logprobs are asked for is computed in full.
            reuse = self.config.enable_prefix_cache and req.params.prompt_logprobs is None
            pages, cached = cache.match(req.all_token_ids, req.block_keys) if reuse else ([], 0)
            n = min(req.num_tokens - cached, budget)
            need = -(-(cached + n) // self.page_size) - len(pages)
            new = cache.alloc_with_eviction(need)
            if new is None:
                cache.allocator.decref(pages)
                break  # the pool is full: wait for running requests to finish
            self.waiting.popleft()
            req.pages = pages + new
            req.num_computed_tokens = req.num_cached_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.prefill.append(PrefillChunk.of(req, cached, n))
            budget -= n
        return out

    def least_loaded_rank(self) -> int:
        """DP attention: the rank a request admitted now goes to: fewest running requests, then most free pages,
        then the lowest rank (0 without DP attention)."""
        if len(self.caches) == 1:
            return 0
        running = self.running_per_rank()
        return min(range(len(self.caches)), key=lambda k: (running[k], -self.caches[k].allocator.num_free, k))

    def running_per_rank(self) -> list[int]:
        """Running requests on each DP rank."""
        counts = [0] * len(self.caches)
        for r in self.running:
            counts[r.dp_rank] += 1
        return counts

    def reached_length_limit(self, req: Request) -> bool:
        """req has all the tokens max_new_tokens or the context allow (the engine finishes it as it reads the last
        one; only overlap scheduling, which reads tokens one step late, asks before that)."""
        return (len(req.output_ids) >= req.params.max_new_tokens
                or req.num_tokens >= self.config.max_model_len)

    def next_step_decodes_only(self) -> bool:
        """Whether the next schedule() is certain to be plain decode rows, without a prompt, a preemption or
        logprobs: the step overlap scheduling may launch before it reads the previous one."""
        if self.spec_steps or self.waiting or not self.running:
            return False
        new_pages = [0] * len(self.caches)
        for req in self.running:
            if not req.is_decoding or req.params.logprobs is not None:
                return False
            if len(req.pages) * self.page_size < req.num_tokens and not self.reached_length_limit(req):
                new_pages[req.dp_rank] += 1  # its row crosses into a new page of its rank's pool
        return all(n <= c.allocator.num_free for n, c in zip(new_pages, self.caches))

    def _num_drafts(self, req: Request, budget: int) -> int:
        # A row yields at most 1 + k tokens: never more than max_new_tokens or the context allow, so neither the
        # output nor the pages reserved for the row go past the request's own limits.
        remaining = min(req.params.max_new_tokens - len(req.output_ids), self.config.max_model_len - req.num_tokens)
        return max(0, min(self.spec_steps, remaining - 1, budget - 1))

    def _reserve_free(self, req: Request, num_tokens: int) -> bool:
        """Make req's pages cover num_tokens from free or evictable pages only (no preemption)."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        new = self.caches[req.dp_rank].alloc_with_eviction(need) if need > 0 else []
        if new is None:
            return False
        req.pages.extend(new)
        return True

    def _reserve(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make req's pages cover num_tokens, preempting later arrivals if the pool is exhausted."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        while need > 0:
            new = self.caches[req.dp_rank].alloc_with_eviction(need)
            if new is not None:
                req.pages.extend(new)
                return True
            # (only a request of the same pool frees pages for this one)
            victim = max((r for r in self.running
                          if r is not req and r.dp_rank == req.dp_rank and not out.holds(r)),
                         key=lambda r: r.arrival_time, default=None)
            if victim is None or victim.arrival_time < req.arrival_time:
                victim = req  # nothing later to evict: this request itself waits
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        # Recompute later from scratch (its full pages stay in the prefix cache, so little is lost).
        self.running.remove(req)
        self._publish(req)
        self.caches[req.dp_rank].allocator.decref(req.pages)
        req.pages, req.num_computed_tokens, req.num_cached_tokens = [], 0, 0
        req.spec = None  # the draft state belongs to KV that is gone; the recompute primes it again
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _publish(self, req: Request) -> None:
        """Register req's full pages in the prefix cache; only tokens whose KV is written count."""
        if self.config.enable_prefix_cache and req.num_computed_tokens:
            self.caches[req.dp_rank].insert(req.all_token_ids[: req.num_computed_tokens], req.pages, req.block_keys)

    def update(self, out: SchedulerOutput) -> None:
        """Account the tokens computed by the step; call it before appending the sampled tokens."""
        for chunk in out.prefill:
            chunk.request.advance(chunk.num_tokens, self.page_size)
            if chunk.request.num_computed_tokens >= chunk.request.num_prompt_tokens:
                self._publish(chunk.request)  # share the prompt with requests arriving while this one decodes
        for req in out.decode:
            req.advance(1, self.page_size)
        # Speculative rows are accounted by update_speculative, once their accepted length is known.

    def update_speculative(self, row: SpecDecode, num_new_tokens: int) -> None:
        """Account a speculative row after its num_new_tokens accepted tokens were appended to the request.

        The verification wrote KV for the row's first token and its drafts; the KV of the row's first
        num_new_tokens positions is right (their inputs were the accepted tokens), the rest is stale and simply
        not counted. Pages reserved beyond the computed tokens go back to the pool, so accounting stays exact.
        """
        req = row.request
        assert 1 <= num_new_tokens <= row.num_tokens, f"{req.request_id}: {num_new_tokens} of {row.num_tokens}"
        req.advance(num_new_tokens, self.page_size)
        keep = -(-req.num_computed_tokens // self.page_size)
        if len(req.pages) > keep:
            # NOTE: these pages hold no computed token, so they were never published to the prefix cache and
            # this request is their only holder.
            self.caches[req.dp_rank].allocator.decref(req.pages[keep:])
            del req.pages[keep:]
