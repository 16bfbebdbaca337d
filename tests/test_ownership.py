"""Prefix-block ownership: the in-process and Redis stores on one scenario, then what only Redis has (sharing
between routers, TTLs, outages) against a real redis-server."""

import os
import signal
import time
from collections import Counter

import pytest
from redis_server import redis_fixture

from pdserve.common.blocks import block_hashes
from pdserve.cluster.ownership import (OWNERSHIP_STORES, MemoryOwnership, OwnershipUnavailable, RedisOwnership,
                                      leading_runs)

redis_server = redis_fixture()

PAGE = 4
P = block_hashes(list(range(16)), PAGE)  # 4 blocks
Q = block_hashes(list(range(8)) + list(range(100, 108)), PAGE)  # shares P's first 2 blocks, then differs
assert len(P) == 4 and Q[:2] == P[:2] and Q[2] != P[2]

FACTORIES = {
    "memory": lambda request: MemoryOwnership(),
    "redis": lambda request: RedisOwnership(request.getfixturevalue("redis_server").url, key_prefix="t"),
}


def test_every_registered_store_is_tested():
    assert sorted(FACTORIES) == OWNERSHIP_STORES.names()
    assert OWNERSHIP_STORES.get("redis") is RedisOwnership and OWNERSHIP_STORES.get("memory") is MemoryOwnership


@pytest.fixture(params=sorted(FACTORIES))
def store(request):
    s = FACTORIES[request.param](request)
    yield s
    s.close()


def test_leading_runs_helper():
    assert leading_runs([{"a", "b"}, {"a"}, set(), {"a", "b"}]) == {"a": 2, "b": 1}
    assert leading_runs([set(), {"a"}]) == {}
    assert leading_runs([]) == {}


def test_match_counts_only_the_leading_run(store):
    store.record("a", [P[0], P[1], P[3]])
    assert store.match(P) == {"a": 2}  # block 3 without block 2 is not reusable
    store.record("a", [P[2]])
    assert store.match(P) == {"a": 4}
    assert store.match(P[:3]) == {"a": 3}
    assert store.match(Q) == {"a": 2}  # the shared prefix only


def test_several_owners(store):
    store.record("a", P)
    store.record("b", P[:1])
    store.record("c", P[1:])  # everything but block 0: worth nothing
    store.record("d", Q)
    assert store.match(P) == {"a": 4, "b": 1, "d": 2}
    assert store.match(Q) == {"a": 2, "b": 1, "d": 4}


def test_remove(store):
    store.record("a", P)
    store.record("b", P)
    store.record("a", P)  # recording twice is the same as once
    store.remove("a", [P[1]])
    assert store.match(P) == {"a": 1, "b": 4}
    store.remove("a", [Q[3]])  # never held: nothing happens
    store.remove("b", [])
    store.remove("a", [P[0]])
    assert store.match(P) == {"b": 4}
    store.remove("b", P)
    assert store.match(P) == {}


def test_drop_worker(store):
    store.record("a", P)
    store.record("a", Q)
    store.record("b", P[:2])
    store.drop_worker("a")
    assert store.match(P) == {"b": 2}
    assert store.match(Q) == {"b": 2}
    store.drop_worker("nobody")
    store.record("a", P[:1])  # a restarted worker starts over
    assert store.match(P) == {"a": 1, "b": 2}


def test_unknown_and_empty(store):
    assert store.match(P) == {}
    store.record("a", P)
    assert store.match(block_hashes(list(range(50, 66)), PAGE)) == {}
    assert store.match([]) == {}
    store.record("a", [])
    assert store.match(P) == {"a": 4}


# ---- Redis only ------------------------------------------------------------------------------------------------
def test_two_routers_share_ownership(redis_server):
    r1, r2 = RedisOwnership(redis_server.url), RedisOwnership(redis_server.url)
    other = RedisOwnership(redis_server.url, key_prefix="other-cluster")
    try:
        r1.record("a", P)
        r2.record("b", P[:2])
        assert r1.match(P) == r2.match(P) == {"a": 4, "b": 2}
        assert other.match(P) == {}
        r2.remove("a", [P[2]])
        assert r1.match(P) == {"a": 2, "b": 2}
        r1.drop_worker("b")
        assert r2.match(P) == {"a": 2}
    finally:
        for s in (r1, r2, other):
            s.close()


def test_malformed_ownership_entries_are_skipped(redis_server):
    """Redis data is untrusted: an owner that is not a worker id (not UTF-8, control characters) on a block, or a
    block hash that is not hex in a worker's index, is skipped; the prompts on that block are still matched (they
    failed with UnicodeDecodeError) and the worker's blocks are still dropped."""
    store = RedisOwnership(redis_server.url, key_prefix="t")
    c = redis_server.client()
    try:
        store.record("a", P[:2])
        c.sadd(f"t:blk:{P[0].hex()}", b"\xff\xfe", b"evil\n")
        c.sadd("t:wblk:a", b"\xff\xfe", b"../x")
        assert store.match(P) == {"a": 2}
        store.drop_worker("a")
        assert store.match(P) == {}
    finally:
        c.close()
        store.close()


def test_signed_owners_are_used_and_unsigned_or_forged_ones_skipped_and_counted(redis_server, monkeypatch):
    """With a secret, a worker's claims are signed (block and worker id under HMAC): a router with the secret uses
    them, and skips, naming why, an unsigned owner, a signature made with another secret, a real claim copied onto
    another block or given to another worker, and bytes no worker writes; each verdict is reached once per
    content; remove and drop_worker take back what was signed."""
    from pdserve.cluster import signing

    worker = RedisOwnership(redis_server.url, key_prefix="t", secret="s3cret")
    rejected: list[tuple[str, str]] = []
    router = RedisOwnership(redis_server.url, key_prefix="t", secret="s3cret",
                            on_rejected=lambda why, key: rejected.append((why, key)))
    guess = RedisOwnership(redis_server.url, key_prefix="t", secret="guess")
    c = redis_server.client()
    try:
        worker.record("a", P)
        (real,) = c.smembers(f"t:blk:{P[3].hex()}")
        assert real.startswith(b"a|") and len(real) == 2 + 64, real
        guess.record("b", P[:1])
        blk0, q2 = f"t:blk:{P[0].hex()}", f"t:blk:{Q[2].hex()}"
        c.sadd(blk0, b"c", b"\xff\xfe", b"a|" + b"0" * 64, b"c" + real[1:])
        c.sadd(q2, real)  # P[3]'s claim, copied to a block Q holds
        assert router.match(P) == {"a": 4}
        assert router.match(Q) == {"a": 2}
        # blk0 is read by both matches (Q shares P's first blocks): c, bytes, a zero mac, c with a's mac, b's guess
        assert Counter(rejected) == {("unsigned", blk0): 2, ("malformed", blk0): 2, ("signature", blk0): 6,
                                     ("signature", q2): 1}, rejected
        macs = []
        real_mac = signing.mac
        monkeypatch.setattr(signing, "mac", lambda *a: macs.append(1) or real_mac(*a))
        assert router.match(P) == {"a": 4} and macs == []  # verdicts kept: nothing verified again
        worker.remove("a", [P[3]])
        assert router.match(P) == {"a": 3}
        worker.drop_worker("a")
        assert router.match(P) == {} and c.smembers(f"t:blk:{P[1].hex()}") == set()
    finally:
        c.close()
        for s in (worker, router, guess):
            s.close()


def test_key_layout_and_ttl(redis_server):
    store = RedisOwnership(redis_server.url, key_prefix="t", ttl_s=100)
    c = redis_server.client()
    try:
        store.record("a", P[:2])
        store.record("b", P[:1])
        blk0, wblk = f"t:blk:{P[0].hex()}", "t:wblk:a"
        assert c.smembers(blk0) == {b"a", b"b"}
        assert c.smembers(wblk) == {P[0].hex().encode(), P[1].hex().encode()}
        for key in (blk0, f"t:blk:{P[1].hex()}", wblk, "t:wblk:b"):
            assert 90 < c.ttl(key) <= 100, key
        c.expire(blk0, 5)
        c.expire(wblk, 5)
        store.record("a", P[:1])  # a record refreshes the TTL
        assert c.ttl(blk0) > 90 and c.ttl(wblk) > 90
        store.remove("a", P[:2])
        store.remove("b", P[:1])
        assert c.exists(blk0, f"t:blk:{P[1].hex()}", "t:wblk:b") == 0  # emptied sets leave no keys behind
        store.record("a", P)
        store.drop_worker("a")
        assert c.keys("t:*") == []
    finally:
        c.close()
        store.close()


@pytest.mark.parametrize("op", ["record", "remove", "match", "drop_worker"])
def test_outage_fails_fast_then_recovers(redis_server, op):
    store = RedisOwnership(redis_server.url, socket_timeout=0.5)
    calls = {"record": lambda: store.record("a", P), "remove": lambda: store.remove("a", P[3:]),
             "match": lambda: store.match(P), "drop_worker": lambda: store.drop_worker("a")}
    try:
        store.record("a", P)
        redis_server.stop()
        for _ in range(2):  # a failed call must not leave the store broken for the next one
            t0 = time.monotonic()
            with pytest.raises(OwnershipUnavailable):
                calls[op]()
            assert time.monotonic() - t0 < 1.0
        redis_server.restart()  # same port, empty (no persistence)
        assert store.match(P) == {}
        store.record("a", P[:3])
        assert store.match(P) == {"a": 3}
    finally:
        store.close()


def test_hung_redis_times_out_and_recovers(redis_server):
    """A Redis that accepts connections but never answers (SIGSTOP) costs about socket_timeout per call, and no
    late reply leaks into a later call once it resumes."""
    store = RedisOwnership(redis_server.url, socket_timeout=0.3)
    try:
        store.record("a", P)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            for call in (lambda: store.match(P), lambda: store.record("b", Q)):
                t0 = time.monotonic()
                with pytest.raises(OwnershipUnavailable):
                    call()
                assert 0.2 < time.monotonic() - t0 < 1.0
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        # Redis may still apply the record("b", Q) that timed out; either way the answers stay exact.
        assert store.match(P) in ({"a": 4}, {"a": 4, "b": 2})
        store.record("c", Q)
        assert store.match(Q) in ({"a": 2, "c": 4}, {"a": 2, "b": 4, "c": 4})
    finally:
        store.close()
