"""A worker's warm-up: run what requests will need before the worker reports SERVING.

On a GPU the first forward of each shape compiles Triton kernels (seconds each with an empty cache) and the first
call of each attention backend plans its work (FlashInfer). A worker that said SERVING before that made its first
requests wait behind those compiles, long enough for the router to drop it (FACTS.md section 9: 63 of 64 requests
failed right after a cold start). CUDA graphs are captured when the engine is built (pdserve/cuda_graph.py); this
runs the rest: prompts of the sizes that matter (1 token, one prefill chunk, a chunk and a bit, several prompts in
one step, a prompt split across steps beside others) and a decode batch per captured decode bucket. Those lengths
stand for every other only because no kernel specializes on a length-derived integer (a Triton variant per
multiple of 16 would compile in a request): tests/test_gpu_warmup.py runs prompts of 2 to 4500 tokens after a
prefill worker's warm-up and fails on any compile.

It drives the engine only through its public API (`add_request`, `step`, `abort`, `has_unfinished`) and leaves it as
it was: no request, no page held, the prefix cache as before (it must be empty then; the warm-up's blocks are
dropped again).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

from pdserve.common.progress import say as _say
from pdserve.engine import LLMEngine
from pdserve.sampling import SamplingParams

# Decode batches are warmed up to this size at most (bigger buckets replay the same kernels through the same graphs).
MAX_WARMUP_BATCH = 256
PROMPT_ODD = 17  # a prompt length that is no multiple of 16 (Triton specializes integer arguments on that)


@dataclass(frozen=True)
class WarmupPlan:
    """What a warm-up runs, one phase after the other, each to completion."""

    prompt_lens: tuple[int, ...] = ()  # one prompt each, one new token: prefill shapes (chunked beyond the budget)
    prompt_batch: int = 0  # then this many short prompts admitted together: several prompts in one prefill step
    # Then 3 prompts of this many tokens admitted together, 2 of them over a step's budget: the second is split, and
    # its rest runs in the next step beside the third, attending to its first part read from the pool (the
    # prefix-attention kernels with several prompts in the step: what a busy prefill worker runs all the time).
    split_prompt_len: int = 0
    decode_batches: tuple[int, ...] = ()  # then one batch each: short prompts admitted together, then decode steps
    decode_tokens: int = 3  # new tokens per request of a decode batch (>= 2: at least one decode step)
    # Then a prompt admitted while others decode: a step with prompt and decode rows together. Only a single-process
    # engine runs those; a prefill worker only computes prompts, a decode worker only decodes.
    mixed: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.prompt_lens or self.prompt_batch or self.decode_batches)


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    requests: int
    steps: int
    phases: tuple[tuple[str, float], ...]  # (what, seconds)

    def summary(self) -> str:
        return ", ".join(f"{what} {s:.2f} s" for what, s in self.phases)


def plan_for(engine: LLMEngine, role: str) -> WarmupPlan:
    """The plan for a worker of `role` ("prefill" | "decode" | "engine": both).

    On the CPU nothing compiles: one short prompt (decode: one short prompt and one decode step) runs every code
    path once, and the first forward's one-time costs are paid before the first request.
    """
    sched, spec = engine.scheduler.config, engine.config.speculative
    decodes, prefills = role in ("decode", "engine"), role in ("prefill", "engine")
    if not str(engine.config.device).startswith("cuda"):
        return WarmupPlan(prompt_lens=(4,) if prefills else (), decode_batches=(1,) if decodes else (),
                          decode_tokens=2)
    capacity = engine.pool.allocator.num_free * engine.pool.page_size
    longest = min(sched.max_model_len - 1, capacity - engine.pool.page_size)
    chunk = sched.max_num_batched_tokens
    # One chunk, and a chunk and a bit (its second chunk reads the first from the pool); the longest prompt when
    # the context is shorter than a chunk.
    lens = sorted({min(n, longest) for n in (1, PROMPT_ODD, chunk, chunk + PROMPT_ODD) if longest >= 1})
    # 3 prompts of n tokens: the first whole and part of the second in one step, the rest of the second (34
    # tokens) and the third in the next. n is no divisor of the chunk, so that the split falls inside a prompt.
    split = min(longest, chunk // 2 + PROMPT_ODD)
    split -= 1 if split > 2 and chunk % split == 0 else 0
    if not prefills or split < 2 or 3 * split <= chunk or 3 * (split + engine.pool.page_size) > capacity:
        split = 0
    if prefills:
        # A prefill worker also runs the NextN layer one token per prompt (the MTP KV it ships): a decode step of
        # batch 1 compiles the same decode-attention kernels.
        batches: tuple[int, ...] = (1,)
        prompt_batch = min(8, sched.max_running_requests)
    else:
        lens, prompt_batch = [1], 0  # a decode worker never computes a prompt; its KV arrives from prefill
    if decodes:
        graphs = engine.config.cuda_graph
        buckets = graphs.buckets() if graphs.enabled else [1, 2, 4, 8, 16, 32, 64]
        top = min(sched.max_running_requests, MAX_WARMUP_BATCH)
        # Batches above the biggest graph run eagerly: one of those too.
        batches = tuple(sorted({b for b in buckets if b <= top} | ({top} if top > max(buckets) else set())))
    width = spec.num_steps + 1 if spec.enabled else 1
    # Enough tokens that a speculative batch runs a full draft/verify round after the first one.
    return WarmupPlan(prompt_lens=tuple(lens), prompt_batch=prompt_batch, split_prompt_len=split,
                      decode_batches=batches, decode_tokens=2 + 2 * width, mixed=prefills and decodes)


def warm_up(engine: LLMEngine, plan: WarmupPlan, say: Optional[Callable[[str], None]] = None,
            seed: int = 0) -> WarmupReport:
    """Run `plan` on an idle engine; returns what it took. Raises RuntimeError if the engine is busy."""
    if engine.has_unfinished:
        raise RuntimeError("warm-up needs an idle engine: it has requests")
    alloc, cache = engine.pool.allocator, engine.prefix_cache
    free_before, cached_before = alloc.num_free, cache.num_cached_pages
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    low = min(10, vocab - 1)  # ids 0..9: where special tokens tend to live
    counter = {"requests": 0, "steps": 0}
    phases: list[tuple[str, float]] = []
    start = time.monotonic()
    # A tier's step hooks (the prefill worker ships each prompt's KV from them) stay out: warm-up requests ship
    # nothing. What the tier computes for a prompt is still computed (the prefill worker's MTP-layer KV).
    tier_hooks = getattr(engine, "hooks", None)
    if tier_hooks is not None:
        engine.hooks = tier_hooks.compute_only()

    def prompt(n: int) -> list[int]:  # random ids: no two warm-up prompts share a cached prefix
        return [rng.randrange(low, vocab) for _ in range(n)]

    def run(what: str, prompts: list[list[int]], new_tokens: int, late: Optional[list[int]] = None) -> None:
        """late: a prompt admitted after the first step, while the others decode."""
        t0 = time.monotonic()
        ids = []
        try:
            for i, p in enumerate(prompts + ([late] if late else [])):
                if late is not None and i == len(prompts):
                    engine.step()
                    counter["steps"] += 1
                # The last request of a batch samples (temperature, top-p, top-k): the sampler's other path.
                sampled = i == len(prompts) - 1 and len(prompts) > 1
                params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                                        top_p=0.9 if sampled else 1.0, top_k=50 if sampled else -1, seed=seed)
                ids.append(engine.add_request(p, params, request_id=f"warmup-{counter['requests']}"))
                counter["requests"] += 1
            while engine.has_unfinished:
                engine.step()
                counter["steps"] += 1
        finally:  # an error mid-way: leave no request behind
            for rid in ids:
                engine.abort(rid)
        phases.append((what, time.monotonic() - t0))
        if say is not None:
            say(f"warm-up: {what} in {phases[-1][1]:.2f} s")

    try:
        for n in plan.prompt_lens:
            run(f"prompt of {n} tokens", [prompt(n)], 1)
        if plan.prompt_batch:
            run(f"{plan.prompt_batch} prompts of {PROMPT_ODD} tokens in one step",
                [prompt(PROMPT_ODD) for _ in range(plan.prompt_batch)], 1)
        if plan.split_prompt_len:
            run(f"3 prompts of {plan.split_prompt_len} tokens, one split across steps",
                [prompt(plan.split_prompt_len) for _ in range(3)], 1)
        page = engine.pool.page_size
        for b in plan.decode_batches:
            per_request = -(-(PROMPT_ODD + plan.decode_tokens) // page) + 1
            if b * per_request > alloc.num_free:
                if say is not None:
                    say(f"warm-up: decode batch {b} skipped ({b * per_request} pages needed, {alloc.num_free} free)")
                continue
            run(f"decode batch {b}", [prompt(PROMPT_ODD) for _ in range(b)], plan.decode_tokens)
        if plan.mixed:
            run("a prompt joining 2 decoding requests", [prompt(PROMPT_ODD) for _ in range(2)], plan.decode_tokens,
                late=prompt(PROMPT_ODD))
    finally:
        if tier_hooks is not None:
            engine.hooks = tier_hooks

    if cached_before == 0 and cache.num_cached_pages:
        on_evict, cache.on_evict = cache.on_evict, None  # nobody was told about the warm-up's blocks
        try:
            cache.reset()
        finally:
            cache.on_evict = on_evict
    # NOTE: internal invariants, not input checks: a warm-up that leaks pages would shrink every later batch.
    assert engine.kv_pages_in_use_by_requests() == 0, "warm-up left pages held by requests"
    assert alloc.num_free == free_before or cached_before, \
        f"warm-up left {free_before - alloc.num_free} pages allocated"
    assert not engine.has_unfinished
    return WarmupReport(time.monotonic() - start, counter["requests"], counter["steps"], tuple(phases))


def warm_up_worker(engine: LLMEngine, role: str, say: Optional[Callable[[str], None]] = None) -> WarmupReport:
    """A worker's warm-up with its progress on stderr: `[pdserve] warm-up: ...`."""
    say = say or _say
    plan = plan_for(engine, role)
    say(f"warm-up: {role} worker on {engine.config.device}: {len(plan.prompt_lens)} prompt sizes, "
        f"{len(plan.decode_batches)} decode batches {list(plan.decode_batches)}")
    report = warm_up(engine, plan, say)
    say(f"warm-up: done in {report.seconds:.2f} s ({role} worker, {report.requests} requests, {report.steps} steps)")
    return report



