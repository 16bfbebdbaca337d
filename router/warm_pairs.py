"""Every prefill/decode pair's KV path, warmed by one short request before real ones need it.

A pair's first request pays for its KV connection: the transport's handshake and, with cuda_ipc, the mapping of the
decode worker's pool into the prefill process, all added to that request's transfer (its second token comes that
much later). Workers cannot pay it in their own warm-up: neither knows the other until the router pairs them. So the
router sends one internal request (two prompt tokens, two new tokens, so the decode worker also admits and steps it)
through each pair it knows before it serves, and through each new pair (a worker started or restarted later) as it
appears. Not counted in the router's metrics (the workers count it). A pair whose warm-up fails is logged and left
to pay at its first real request; it is not retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Callable

from pdserve.common.progress import say as _say
from pdserve.common.values import SamplingParams

from .workers import Worker, WorkerPool

log = logging.getLogger(__name__)

WARM_PARAMS = SamplingParams(max_new_tokens=2, ignore_eos=True)
WARM_TIMEOUT_S = 60.0

# relay(request_id, prompt_ids, params, prefill, decode, deadline): the router's relay of one request, uncounted.
Relay = Callable[[str, list[int], SamplingParams, Worker, Worker, float], AsyncIterator]


def cold_pairs(pool: WorkerPool) -> list[tuple[Worker, Worker]]:
    """Healthy pairs that can pair (same KV layout) and have not been warmed since either (re)joined."""
    return [(p, d) for p in pool.of_role("prefill") for d in pool.of_role("decode")
            if p.info is not None and d.info is not None and not p.layout.mismatch(d.layout)
            and not (d.address in p.warmed_with and p.address in d.warmed_with)]


async def warm_pairs(pool: WorkerPool, relay: Relay, vocab_size: Callable[[], int],
                     timeout_s: float = WARM_TIMEOUT_S) -> int:
    """One request through every cold pair at once; returns how many went through. vocab_size() is asked only when
    there is a pair (it needs a worker's info)."""
    pairs = cold_pairs(pool)
    if not pairs:
        return 0
    for p, d in pairs:  # attempted: not tried again while both stay up
        p.warmed_with.add(d.address)
        d.warmed_with.add(p.address)
    start = time.monotonic()
    prompt = [min(10, vocab_size() - 1)] * 2

    async def one(p: Worker, d: Worker) -> bool:
        try:
            async for _ in relay(f"warm-{uuid.uuid4().hex}", prompt, WARM_PARAMS, p, d, start + timeout_s):
                pass
            return True
        except Exception as e:  # noqa: BLE001 - the pair's first real request pays instead, as without warm-up
            log.warning("warming the KV path %s -> %s failed (its first request will pay for the connection): %s",
                        p.address, d.address, e)
            return False

    _say(f"warming the KV path of {len(pairs)} prefill/decode pair(s) with a request of the router's own ...")
    done = sum(await asyncio.gather(*(one(p, d) for p, d in pairs)))
    _say(f"warmed the KV path of {done} of {len(pairs)} prefill/decode pairs in {time.monotonic() - start:.2f} s")
    return done


async def keep_pairs_warm(pool: WorkerPool, relay: Relay, vocab_size: Callable[[], int]) -> None:
    """Warm the pairs of workers that join or come back, at each health refresh."""
    while True:
        await asyncio.sleep(pool.refresh_s)
        try:
            await warm_pairs(pool, relay, vocab_size)
        except Exception:  # never let it end the loop (a worker with no info yet, a race with its going down)
            log.exception("warming new prefill/decode pairs failed")

