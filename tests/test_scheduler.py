"""The continuous-batching scheduler on the CPU, driven like LLMEngine.step by a fake model (vLLM tests/v1/core style).

The fake model keeps a paged "KV cache" of token ids: each computed token's id is written to its slot through the
request's page table, and the next token is a function of what is read back. A page handed to two requests, or a
cached prefix that does not hold the request's tokens, therefore changes the output, as it would on a GPU.
"""

from __future__ import annotations

import pytest

from pdserve.kv_cache import CacheConfig, PageAllocator
from pdserve.prefix_cache import PrefixCache
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.sampling import SamplingParams
from pdserve.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def fake_token(ids: list[int]) -> int:
    """The "model": depends on the request's own tokens only (order-sensitive), never on batching."""
    return (7 * sum((i + 1) * t for i, t in enumerate(ids)) + len(ids)) % 50


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 17 * i) % 97 for i in range(n)]


class Harness:
    """A Scheduler plus the engine loop around it: schedule -> fake forward -> update -> append -> finish."""

    def __init__(self, page_size=4, num_pages=64, dp=1, **sched):
        """dp: DP-attention ranks, each with a pool of num_pages (and its own "KV cache")."""
        self.ps = page_size
        self.caches = [PrefixCache(PageAllocator(num_pages), page_size) for _ in range(dp)]
        self.prefix_cache, self.allocator = self.caches[0], self.caches[0].allocator
        self.sched = Scheduler(SchedulerConfig(**sched), CacheConfig(page_size, num_pages), self.prefix_cache,
                               dp_caches=self.caches[1:])
        self.kvs: list[list] = [[None] * (num_pages * page_size) for _ in range(dp)]  # token id per slot, per rank
        self.steps: list[SchedulerOutput] = []
        self.samples: list[list[bool]] = []  # per step, PrefillChunk.samples as scheduled (it reads live state)
        self.arrivals = 0

    def add(self, ids, max_new=4) -> Request:
        self.arrivals += 1  # distinct, increasing arrival times
        req = Request(f"r{self.arrivals}", list(ids), SamplingParams(max_new_tokens=max_new),
                      arrival_time=float(self.arrivals))
        self.sched.add(req)
        return req

    def _forward(self, req: Request, start: int, end: int) -> int:
        """Write KV for tokens [start, end), read [0, end) back, and return the token sampled from it."""
        assert len(req.pages) * self.ps >= end, f"{req.request_id}: tokens up to {end} beyond its pages"
        slot = lambda p: req.pages[p // self.ps] * self.ps + p % self.ps  # noqa: E731
        kv, allocator = self.kvs[req.dp_rank], self.caches[req.dp_rank].allocator  # its rank's pool
        for p in range(start, end):
            assert allocator.refcount(req.pages[p // self.ps]) == 1, f"{req.request_id} writes a shared page"
            kv[slot(p)] = req.all_token_ids[p]
        seen = [kv[slot(p)] for p in range(end)]
        assert seen == req.all_token_ids[:end], f"{req.request_id} reads KV that is not its own tokens"
        return fake_token(seen)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self._check_output(out)
        self.samples.append([c.samples for c in out.prefill])
        tokens = [self._forward(c.request, c.start, c.start + c.num_tokens) for c in out.prefill]
        sampled = [(c.request, t) for c, t, s in zip(out.prefill, tokens, self.samples[-1]) if s]
        sampled += [(r, self._forward(r, r.num_tokens - 1, r.num_tokens)) for r in out.decode]
        self.sched.update(out)
        for req, tok in sampled:
            req.output_ids.append(tok)
            if len(req.output_ids) >= req.params.max_new_tokens or req.num_tokens >= self.sched.config.max_model_len:
                self.sched.finish(req, FinishReason.LENGTH)
        self.steps.append(out)
        self.check_pages()
        return out

    def run(self, max_steps=500) -> None:
        while self.sched.has_unfinished:
            assert len(self.steps) < max_steps, "scheduler did not finish in a bounded number of steps"
            assert not self.step().is_empty, "nothing scheduled while requests are unfinished: a deadlock"

    def _check_output(self, out: SchedulerOutput) -> None:
        cfg = self.sched.config
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.sched.running) <= cfg.max_running_requests
        scheduled = [c.request for c in out.prefill] + out.decode
        assert len(set(map(id, scheduled))) == len(scheduled), "a request scheduled twice in one step"
        for c in out.prefill:
            assert c.start == c.request.num_computed_tokens and c.num_tokens >= 1
            assert c.start + c.num_tokens <= c.request.num_tokens
        assert all(r.is_decoding for r in out.decode)
        assert all(r.status is RequestStatus.RUNNING and r in self.sched.running for r in scheduled)
        for r in out.preempted:
            assert r.num_preemptions > 0
            if r not in scheduled:  # recomputed from scratch later
                assert r.status is RequestStatus.WAITING and r in self.sched.waiting
                assert r.pages == [] and r.num_computed_tokens == 0

    def check_pages(self) -> None:
        """Pages cover computed tokens; a page held by several requests is shared through the prefix cache (of
        each DP rank's pool)."""
        assert all(not r.pages for r in self.sched.waiting)
        for rank, cache in enumerate(self.caches):
            holders: dict[int, int] = {}
            for r in self.sched.running:
                if r.dp_rank != rank:
                    continue
                assert len(r.pages) * self.ps >= r.num_computed_tokens
                assert len(set(r.pages)) == len(r.pages)
                for p in r.pages:
                    holders[p] = holders.get(p, 0) + 1
            for p, n in holders.items():
                assert cache.allocator.refcount(p) - n in (0, 1), f"page {p}: refcount vs {n} holders"
                if n > 1:
                    assert cache.allocator.refcount(p) == n + 1, f"page {p} shared by {n} requests outside the cache"
            assert cache.allocator.num_used == len(holders) + cache.num_cache_only_pages

    def assert_idle(self) -> None:
        assert not self.sched.has_unfinished
        for cache in self.caches:
            cache.reset()
            assert cache.allocator.num_used == 0

    def chunks(self, req: Request) -> list[tuple[int, int, bool, int]]:
        """(start, num_tokens, samples, step) of each prefill chunk of req."""
        return [(c.start, c.num_tokens, s, i) for i, (out, ss) in enumerate(zip(self.steps, self.samples))
                for c, s in zip(out.prefill, ss) if c.request is req]


def run_alone(ids, max_new) -> list[int]:
    """The reference: the request alone, with a pool that never runs out."""
    h = Harness(page_size=2, num_pages=256)
    req = h.add(ids, max_new)
    h.run()
    return req.output_ids


# ---- token budget and chunked prefill --------------------------------------------------------------------------
def test_long_prompts_run_in_contiguous_chunks_within_the_budget():
    h = Harness(max_num_batched_tokens=8)
    reqs = [h.add(prompt(n, i), max_new=3) for i, n in enumerate([30, 5, 17, 8])]
    h.run()
    for req in reqs:
        starts, sizes, samples, _ = zip(*h.chunks(req))
        assert list(starts) == [sum(sizes[:i]) for i in range(len(sizes))]  # contiguous from 0
        assert sum(sizes) == req.num_prompt_tokens  # the prompt exactly once
        assert samples == (False,) * (len(sizes) - 1) + (True,)
        assert req.output_ids == run_alone(req.prompt_ids, 3)
    assert max(out.num_tokens for out in h.steps) == 8  # the budget is used, not just respected
    h.assert_idle()
    alone = Harness(max_num_batched_tokens=8)
    req = alone.add(prompt(30, 0), max_new=3)
    alone.run()
    assert [n for _, n, *_ in alone.chunks(req)] == [8, 8, 8, 6]  # a continued prompt gets the whole budget too


def test_one_decode_row_per_step_until_finished():
    h = Harness(max_num_batched_tokens=16)
    reqs = [h.add(prompt(n, i), max_new=m) for i, (n, m) in enumerate([(20, 6), (3, 9), (9, 1), (12, 4)])]
    h.run()
    for req in reqs:
        sample_step = next(step for *_, samples, step in h.chunks(req) if samples)
        finish_step = sample_step + req.params.max_new_tokens - 1
        for i, out in enumerate(h.steps):
            rows = sum(r is req for r in out.decode)
            assert rows == (1 if sample_step < i <= finish_step else 0), (req.request_id, i)
            if i > sample_step:
                assert all(c.request is not req for c in out.prefill)
        assert len(req.output_ids) == req.params.max_new_tokens and req.finish_reason is FinishReason.LENGTH
    h.assert_idle()


# ---- admission -------------------------------------------------------------------------------------------------
def test_fcfs_admission_and_max_running_requests():
    h = Harness(max_running_requests=2, max_num_batched_tokens=64)
    reqs = [h.add(prompt(4 + i, i), max_new=2 + (i * 3) % 5) for i in range(6)]
    h.step()
    assert h.sched.running == reqs[:2] and list(h.sched.waiting) == reqs[2:]
    h.run()
    first = [next(i for i, out in enumerate(h.steps) if any(c.request is r for c in out.prefill)) for r in reqs]
    assert first == sorted(first)  # admitted in arrival order
    assert max(len(out.prefill) + len(out.decode) for out in h.steps) == 2
    assert all(r.num_preemptions == 0 and r.output_ids == run_alone(r.prompt_ids, r.params.max_new_tokens)
               for r in reqs)
    h.assert_idle()


def test_add_rejects_prompt_of_max_model_len():
    h = Harness(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        h.add(prompt(16, 0))
    req = h.add(prompt(15, 0), max_new=8)  # one token of room: the engine stops it after its first token
    h.run()
    assert len(req.output_ids) == 1 and req.finish_reason is FinishReason.LENGTH
    h.assert_idle()


# ---- prefix cache ----------------------------------------------------------------------------------------------
def computed_tokens(h: Harness, req: Request) -> int:
    return sum(n for _, n, *_ in h.chunks(req)) + sum(r is req for out in h.steps for r in out.decode)


@pytest.mark.parametrize("enable", [True, False])
def test_second_request_reuses_the_finished_prompt(enable):
    h = Harness(page_size=4, enable_prefix_cache=enable)
    ids = prompt(27, 5)
    first = h.add(ids, max_new=5)
    h.run()
    second = h.add(ids, max_new=5)
    h.run()
    assert first.num_cached_tokens == 0
    if enable:
        assert 0 < second.num_cached_tokens < len(ids) and second.num_cached_tokens % 4 == 0
        assert computed_tokens(h, second) == computed_tokens(h, first) - second.num_cached_tokens
    else:
        assert second.num_cached_tokens == 0 and computed_tokens(h, second) == computed_tokens(h, first)
    assert second.output_ids == first.output_ids
    h.assert_idle()


def test_running_requests_share_prefix_pages_with_refcounts():
    h = Harness(page_size=4)
    shared = prompt(16, 9)
    a = h.add(shared + [1, 2, 3], max_new=6)
    h.step()  # a's prompt is computed and published
    b = h.add(shared + [4, 5], max_new=6)
    h.step()
    assert b.num_cached_tokens == 16 and b.pages[:4] == a.pages[:4]
    assert all(h.allocator.refcount(p) == 3 for p in a.pages[:4])  # a, b and the cache
    assert not set(a.pages[4:]) & set(b.pages[4:])
    h.run()
    assert a.output_ids == run_alone(a.prompt_ids, 6) and b.output_ids == run_alone(b.prompt_ids, 6)
    h.assert_idle()


# ---- preemption under a tiny pool ------------------------------------------------------------------------------
@pytest.mark.parametrize("enable", [True, False])
def test_preemption_recomputes_and_keeps_outputs(enable):
    h = Harness(page_size=2, num_pages=8, max_num_batched_tokens=6, enable_prefix_cache=enable)
    reqs = [h.add(prompt(5, i), max_new=6) for i in range(4)]  # 6 pages each at the end; 8 in the pool
    h.run(max_steps=300)
    # The most recently arrived request is the victim, so the first one never is.
    assert reqs[0].num_preemptions == 0 and reqs[-1].num_preemptions > 0
    for r in reqs:
        assert r.output_ids == run_alone(r.prompt_ids, 6), r.request_id
        assert r.finish_reason is FinishReason.LENGTH
    # Preempted requests restart from token 0, or from a page-aligned prefix the cache kept; never mid-page.
    for i, out in enumerate(h.steps):
        for r in out.preempted:
            start = next(start for start, _, _, step in h.chunks(r) if step >= i)
            assert start % 2 == 0 and (enable or start == 0)
    h.assert_idle()


def test_the_latest_arrival_is_the_victim():
    h = Harness(page_size=2, num_pages=6)
    a, b, c = h.add(prompt(4, 0)), h.add(prompt(3, 1)), h.add(prompt(3, 2))  # 2 pages each: the pool is full
    h.step()
    out = h.step()  # a's fifth token needs a third page; b and c fit theirs
    assert out.preempted == [c] and out.decode == [a, b] and c.num_preemptions == 1
    h.run()
    assert a.num_preemptions == 0 and all(r.output_ids == run_alone(r.prompt_ids, 4) for r in (a, b, c))
    h.assert_idle()


# ---- requests larger than the whole pool -----------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len, max_new", [(12, 2), (5, 6)])  # the prompt / prompt + output exceed 8 slots
def test_request_larger_than_the_pool_is_rejected_and_blocks_nothing(prompt_len, max_new):
    h = Harness(page_size=2, num_pages=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="num_pages=4"):
        h.add(prompt(prompt_len, 0), max_new=max_new)
    assert not h.sched.has_unfinished
    small = h.add(prompt(3, 1), max_new=2)
    for _ in range(30):
        h.step()
    assert small.is_finished and small.output_ids == run_alone(small.prompt_ids, 2)
    h.assert_idle()


# ---- abort -----------------------------------------------------------------------------------------------------
def test_abort_waiting_and_running_requests_frees_pages():
    h = Harness(page_size=4, max_running_requests=1)
    running, waiting = h.add(prompt(10, 1), max_new=8), h.add(prompt(6, 2), max_new=8)
    h.step(), h.step()
    used = h.allocator.num_used
    assert running.status is RequestStatus.RUNNING and len(running.pages) == 3 and waiting in h.sched.waiting
    assert h.sched.abort(waiting.request_id) is waiting
    assert waiting not in h.sched.waiting and h.allocator.num_used == used
    assert h.sched.abort(running.request_id) is running
    assert not h.sched.has_unfinished and running.pages == []
    assert h.allocator.num_used == h.prefix_cache.num_cache_only_pages == 2  # its two full prompt pages stay cached
    for r in (running, waiting):
        assert r.finish_reason is FinishReason.ABORT and r.status is RequestStatus.FINISHED
    assert h.sched.abort("nope") is None and h.sched.abort(running.request_id) is None
    h.assert_idle()


# ---- DP attention: one pool per rank ---------------------------------------------------------------------------
def test_dp_attention_spreads_requests_and_holds_twice_the_tokens():
    """Two ranks, each with the pool one TP rank would have: requests go to the least-loaded rank and live in its
    pool, so two requests that each need most of one pool run at once; with one pool (TP) the second waits."""
    big = [prompt(50, 1), prompt(50, 2)]  # 50 + 4 tokens: 14 of the 16 pages of one pool
    outs = {}
    for dp in (1, 2):
        h = Harness(page_size=4, num_pages=16, dp=dp, max_num_batched_tokens=128)
        reqs = [h.add(ids, max_new=4) for ids in big]
        h.step()
        outs[dp] = (len(h.sched.running), [r.dp_rank for r in h.sched.running])
        h.run()
        assert [r.output_ids for r in reqs] == [run_alone(ids, 4) for ids in big]
        assert all(r.num_preemptions == 0 for r in reqs)
        h.assert_idle()
    assert outs == {1: (1, [0]), 2: (2, [0, 1])}


def test_dp_attention_places_by_load_and_preempts_within_a_rank():
    """Mixed lengths over two small pools: every token as computed alone, pages only in the request's rank's pool
    (Harness checks each), preemptions only when that rank's pool is full, and ranks idle in turn at the end."""
    h = Harness(page_size=2, num_pages=12, dp=2, max_num_batched_tokens=16)
    reqs = [h.add(prompt(n, i), max_new=m) for i, (n, m) in enumerate([(9, 12), (3, 2), (17, 6), (5, 18), (11, 3),
                                                                       (2, 9)])]
    per_step = []
    while h.sched.has_unfinished:
        assert not h.step().is_empty
        per_step.append(h.sched.running_per_rank())
    assert [r.output_ids for r in reqs] == [run_alone(r.prompt_ids, r.params.max_new_tokens) for r in reqs]
    assert {r.dp_rank for r in reqs} == {0, 1} and any(r.num_preemptions for r in reqs)
    assert any(min(n) == 0 < max(n) for n in per_step)  # one rank idle while the other works
    h.assert_idle()
