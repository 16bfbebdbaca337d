"""Workers registering themselves in a real redis-server and routers discovering them: heartbeat, expiry, clean
deregistration, malformed entries, and Redis restarts (which lose everything, persistence being off)."""

import json
import logging
import time

import pytest
from redis_server import redis_fixture

from pdserve.cluster.worker_registry import (
    RegistryUnavailable, WorkerRegistration, discover_workers, registration_problem, sign_registration, worker_key,
)

redis_server = redis_fixture()

PREFILL = {"worker_id": "p0", "role": "prefill", "address": "10.0.0.1:50051", "metrics_port": None}
DECODE = {"worker_id": "d0", "role": "decode", "address": "10.0.0.2:50052"}


def wait_until(cond, timeout_s: float) -> float:
    """Seconds until cond() held; fails the test after timeout_s."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"condition not met within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_register_discover_and_deregister(redis_server):
    p = WorkerRegistration(redis_server.url, key_prefix="t").start(PREFILL)
    d = WorkerRegistration(redis_server.url, key_prefix="t").start(DECODE)
    assert discover_workers(redis_server.url, "prefill", "t") == [PREFILL]
    assert discover_workers(redis_server.url, "decode", "t") == [DECODE]
    assert discover_workers(redis_server.url, "prefill", "other") == []
    c = redis_server.client()
    assert json.loads(c.get("t:worker:prefill:p0")) == PREFILL == json.loads(c.get(worker_key("t", "prefill", "p0")))
    assert 0 < c.pttl("t:worker:prefill:p0") <= 5000
    p.stop()
    assert discover_workers(c, "prefill", "t") == []  # gone at once, no TTL wait; a client works as well as a URL
    assert discover_workers(c, "decode", "t") == [DECODE]
    d.stop()
    assert c.keys("t:*") == []
    c.close()


def test_many_workers_are_all_found_by_scan(redis_server):
    regs = [WorkerRegistration(redis_server.url, key_prefix="t").start(
        {"worker_id": f"p{i:03d}", "role": "prefill", "address": f"h:{i}"}) for i in range(120)]
    try:
        found = discover_workers(redis_server.url, "prefill", "t")
        assert [w["worker_id"] for w in found] == [f"p{i:03d}" for i in range(120)]
    finally:
        for r in regs:
            r.stop()


def test_heartbeat_keeps_key_then_it_expires_when_heartbeat_stops(redis_server):
    reg = WorkerRegistration(redis_server.url, key_prefix="t", ttl_s=1.0).start(PREFILL)
    time.sleep(1.5)  # longer than the TTL: only the heartbeat keeps it
    assert discover_workers(redis_server.url, "prefill", "t") == [PREFILL]
    reg.stop(deregister=False)  # as if the process died
    assert discover_workers(redis_server.url, "prefill", "t") == [PREFILL]
    gone_after = wait_until(lambda: discover_workers(redis_server.url, "prefill", "t") == [], 2.0)
    assert gone_after <= 1.3  # the TTL left was at most 1 s


def test_malformed_entries_are_skipped(redis_server):
    c = redis_server.client()
    c.set("t:worker:prefill:bad", "{not json")
    c.set("t:worker:prefill:list", "[1, 2]")
    c.set("t:worker:prefill:noaddr", json.dumps({"worker_id": "x", "role": "prefill"}))
    c.set("t:worker:prefill:binary", b"\xff\xfe")
    c.set("t:worker:prefill:ok", json.dumps(PREFILL))
    assert discover_workers(redis_server.url, "prefill", "t") == [PREFILL]
    c.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="role"):
        WorkerRegistration("redis://127.0.0.1:1").start({**PREFILL, "role": "router"})
    with pytest.raises(ValueError, match="address"):
        WorkerRegistration("redis://127.0.0.1:1").start({"worker_id": "p0", "role": "prefill"})
    with pytest.raises(ValueError, match="role"):
        discover_workers("redis://127.0.0.1:1", "router")


def test_discover_raises_registry_unavailable_fast(redis_server):
    redis_server.stop()
    t0 = time.monotonic()
    with pytest.raises(RegistryUnavailable):
        discover_workers(redis_server.url, "prefill", "t")
    assert time.monotonic() - t0 < 1.0


def test_heartbeat_reregisters_after_redis_restart(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.cluster.worker_registry")
    reg = WorkerRegistration(redis_server.url, key_prefix="t", ttl_s=1.0).start(PREFILL)
    try:
        redis_server.stop()
        time.sleep(1.0)  # about three failed heartbeats
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        redis_server.restart()
        assert redis_server.client().keys("*") == []  # the restart lost the registration
        wait_until(lambda: discover_workers(redis_server.url, "prefill", "t") == [PREFILL], 1.5)
        redis_server.restart()  # a second, brief outage heals the same way
        wait_until(lambda: discover_workers(redis_server.url, "prefill", "t") == [PREFILL], 1.5)
    finally:
        reg.stop()
    assert discover_workers(redis_server.url, "prefill", "t") == []


def test_start_while_redis_is_down_registers_once_it_is_up(redis_server):
    redis_server.stop()
    t0 = time.monotonic()
    reg = WorkerRegistration(redis_server.url, key_prefix="t", ttl_s=1.0).start(DECODE)  # must not raise
    assert time.monotonic() - t0 < 1.0
    try:
        redis_server.start()
        wait_until(lambda: discover_workers(redis_server.url, "decode", "t") == [DECODE], 1.5)
    finally:
        reg.stop()


def test_signed_registrations_and_what_a_router_refuses(redis_server):
    """With a secret, heartbeats sign the entry; discovery with the secret returns it and refuses (naming why)
    an unsigned entry, one whose address was changed, one signed with another secret, and a stale copy."""
    reg = WorkerRegistration(redis_server.url, key_prefix="t", secret="s3cret").start(DECODE)
    c = redis_server.client()
    signed = json.loads(c.get("t:worker:decode:d0"))
    assert {k: signed[k] for k in DECODE} == DECODE and registration_problem(signed, "s3cret") is None
    forged = {
        "t:worker:decode:zz-unsigned": {"worker_id": "zz-unsigned", "role": "decode", "address": "10.6.6.6:1"},
        "t:worker:decode:zz-moved": {**signed, "worker_id": "zz-moved", "address": "10.6.6.6:2"},
        "t:worker:decode:zz-other-key": sign_registration({**DECODE, "worker_id": "zz-other-key"}, "guess"),
        "t:worker:decode:zz-stale": sign_registration({**DECODE, "worker_id": "zz-stale"}, "s3cret",
                                                      now=time.time() - 120),
    }
    for key, info in forged.items():
        c.set(key, json.dumps(info), px=60000)
    rejected = []
    found = discover_workers(c, "decode", "t", secret="s3cret", on_rejected=lambda k, why, _: rejected.append(
        (k, why)))
    assert [w["worker_id"] for w in found] == ["d0"]
    assert sorted(rejected) == [("t:worker:decode:zz-moved", "signature"), ("t:worker:decode:zz-other-key",
                                                                         "signature"),
                                ("t:worker:decode:zz-stale", "expired"), ("t:worker:decode:zz-unsigned", "unsigned")]
    # Without a secret nothing can be told apart: every entry is used (the README says what that means).
    assert len(discover_workers(c, "decode", "t")) == 5
    # A copy of the real entry is the real worker's address, and it stops verifying once it is old.
    assert registration_problem(signed, "s3cret", now=signed["signed_at"] + 31) == "expired"
    reg.stop()
    c.close()


def test_a_malformed_entry_is_skipped_and_named_never_stopping_discovery(redis_server):
    """Redis data is untrusted: a signature no worker writes (a lone surrogate made the check raise on every
    refresh, so no worker was ever found again), or fields of the wrong type, are skipped and reported; the real
    worker is still found."""
    reg = WorkerRegistration(redis_server.url, key_prefix="t", secret="s3cret").start(DECODE)
    c = redis_server.client()
    signed = json.loads(c.get("t:worker:decode:d0"))
    c.set("t:worker:decode:zz-surrogate", '{"worker_id": "zz", "role": "decode", "address": "10.6.6.6:1", '
                                          '"signed_at": %f, "signature": "\\udc80"}' % time.time())
    c.set("t:worker:decode:zz-types", json.dumps({**signed, "worker_id": ["x"]}))
    c.set("t:worker:decode:zz-address", json.dumps({**signed, "worker_id": "zz-address", "address": "a\nb"}))
    rejected = []
    found = discover_workers(c, "decode", "t", secret="s3cret",
                             on_rejected=lambda k, why, _: rejected.append((k, why)))
    assert [w["worker_id"] for w in found] == ["d0"]
    assert sorted(rejected) == [("t:worker:decode:zz-address", "malformed"), ("t:worker:decode:zz-surrogate",
                                                                            "signature"),
                                ("t:worker:decode:zz-types", "malformed")]
    reg.stop()
    c.close()


def test_an_unchanged_entry_is_verified_once(redis_server, monkeypatch):
    """With the caller's `verified` Verdicts, polls re-verify only entries whose content changed (thousands of forged
    entries cost the router a core when each was verified every second); expiry is still applied on every poll."""
    from pdserve.cluster import signing, worker_registry

    c = redis_server.client()
    for i in range(50):
        c.set(f"t:worker:decode:forged-{i}", json.dumps(sign_registration({**DECODE, "worker_id": f"f{i}"}, "guess")))
    c.set("t:worker:decode:d0", json.dumps(sign_registration(DECODE, "s3cret")))
    macs = []
    real_mac = signing.mac
    monkeypatch.setattr(signing, "mac", lambda *a: macs.append(1) or real_mac(*a))
    verified = signing.Verdicts()
    for _ in range(3):
        found = discover_workers(c, "decode", "t", secret="s3cret", verified=verified)
        assert [w["worker_id"] for w in found] == ["d0"]
    assert len(macs) == 51  # the first poll only
    monkeypatch.setattr(worker_registry.time, "time", lambda: time.monotonic() + 1e9)  # long after: expired
    assert discover_workers(c, "decode", "t", secret="s3cret", verified=verified) == []
    c.close()
