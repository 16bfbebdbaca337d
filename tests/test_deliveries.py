"""Deliveries: results handed from the engine thread to the event loop's waiting futures."""

import asyncio
import threading

from pdserve.serving.worker_common import Deliveries


def test_resolve_many_settles_every_waiting_key_in_one_hand_off_from_another_thread():
    async def main():
        loop = asyncio.get_running_loop()
        deliveries = Deliveries(loop)
        waiting = {key: deliveries.expect(key) for key in ("a", "b", "c")}
        deliveries.discard("c")  # given up on (its call ended): a late value for it goes nowhere
        hand_offs = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (hand_offs.append(a), real(*a))[1]
        thread = threading.Thread(target=deliveries.resolve_many, args=([("a", 1), ("b", 2), ("c", 3), ("x", 4)],))
        thread.start()
        thread.join()
        assert await asyncio.wait_for(asyncio.gather(waiting["a"], waiting["b"]), 5) == [1, 2]
        assert not waiting["c"].done() and len(hand_offs) == 1
        deliveries.resolve_many([])  # nothing to settle: no hand-off
        assert len(hand_offs) == 1

    asyncio.run(main())


def test_resolve_still_fails_a_single_key():
    async def main():
        deliveries = Deliveries(asyncio.get_running_loop())
        fut = deliveries.expect("a")
        deliveries.resolve("a", error=ValueError("no"))
        try:
            await asyncio.wait_for(fut, 5)
        except ValueError as e:
            return str(e)

    assert asyncio.run(main()) == "no"
