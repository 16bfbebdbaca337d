"""How the router picks a prefill worker by prefix ownership, and how little of a fresh prompt it hashes to do so:
where no worker holds the first block no worker holds a longer prefix, so the prompt's other keys wait until the
request is done (the ownership is learnt then), off its first token's way."""

from __future__ import annotations

import asyncio

from pdserve.cluster.ownership import MemoryOwnership
from pdserve.common.blocks import block_hashes
from pdserve.common.values import KVLayout
from pdserve.router.server import Router, RouterConfig
from pdserve.router.workers import Worker, WorkerPool
from pdserve.serving.metrics import Metrics
from pdserve.serving.rpc_convert import layout_to_proto
from pdserve.v1 import worker_pb2 as pb

BLOCK = 4
LAYOUT = KVLayout("m", page_size=BLOCK, num_kv_layers=2, kv_dim=8, dtype="bfloat16")


class CountingOwnership(MemoryOwnership):
    def __init__(self):
        super().__init__()
        self.asked: list[int] = []  # keys per match

    def match(self, hashes):
        self.asked.append(len(hashes))
        return super().match(hashes)


def _worker(address: str, role: str) -> Worker:
    w = Worker(address, role, channel=None, stub=None, healthy=True)
    w.info = pb.WorkerInfo(worker_id=address, address=address, layout=layout_to_proto(LAYOUT), block_size=BLOCK)
    return w


def test_a_fresh_prompt_is_routed_on_its_first_blocks_key_and_its_other_keys_are_made_when_learnt():
    async def main():
        pool = WorkerPool({})
        for address, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
            pool.workers[address] = _worker(address, role)
        store = CountingOwnership()
        router = Router(RouterConfig(), pool, store, Metrics.create("router"), None)
        prompt = list(range(100, 140))  # 10 blocks

        _, _, hashes, reason = await router.choose(prompt)
        assert (hashes, reason, store.asked) == (None, "load", [1])  # one key asked for, none kept

        router._learn_ownership(pool.workers["p1"], prompt, hashes, pb.PrefillResponse())  # (the request is done)
        assert store.match(block_hashes(prompt, BLOCK)) == {"p1": 10}

        store.asked.clear()
        again = prompt[:30] + [7, 7, 7, 7, 7]  # the first 7 blocks shared
        prefill, _, hashes, reason = await router.choose(again)
        assert (prefill.address, reason, store.asked) == ("p1", "prefix_hit", [1, 8])
        assert hashes == block_hashes(again, BLOCK)  # all of them: recorded as they are when the request is done

        short = prompt[:BLOCK + 1]  # one block: its key is all there is
        assert (await router.choose(short))[2] == block_hashes(short, BLOCK)
        assert (await router.choose(prompt[:BLOCK - 1]))[2] == []  # no full block: nothing to hash or ask
        router.checks.close()

    asyncio.run(main())
