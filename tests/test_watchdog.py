"""A frozen decode worker (SIGSTOP, real processes) under load: every request it holds ends (tokens or UNAVAILABLE)
within the router's detection time plus a margin, whatever the client's deadline; new requests go to the other decode
worker meanwhile; after SIGCONT it rejoins by itself and is left holding nothing."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from stack import load, start_stack, wait_idle
from test_faults import one, requests_finished
from test_serving_redis import counters, wait_until

pytestmark = pytest.mark.slow
# The router's defaults: 2 missed checks of 1 s, 1 s apart (HealthConfig.frozen_detect_s = 4 s).
DETECT_S = 4.0
MARGIN_S = 4.0  # two shared CPU cores
NO_DEADLINE = 120.0  # as good as none: the clients waited as long as the worker stayed frozen


@pytest.fixture(scope="module")
def stack(tiny_v3_dir, tmp_path_factory):
    """1 prefill + 2 decode workers for both tests (the first leaves every worker serving and idle: it checks that)."""
    s = start_stack(tiny_v3_dir, tmp_path_factory.mktemp("logs-watchdog"), n_prefill=1, n_decode=2)
    yield s
    s.stop()


def test_frozen_decode_worker_fails_over_and_rejoins(stack):
    address, victim, survivor = stack.router.address, stack.decode[0], stack.decode[1]
    results: list[tuple[float, float, str, int]] = []  # (start, end, status, tokens)
    last_start = [0.0] * 8  # per client, when its last finished request started
    stop = threading.Event()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            start = time.monotonic()
            status, tokens, seconds = one(address, [10 + i, 11 + n % 50, 12, 13], 150, timeout=NO_DEADLINE)
            results.append((start, start + seconds, status, tokens))
            last_start[i] = start
            n += 1

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, i) for i in range(8)]
        deadline = time.monotonic() + 20
        while load(victim).num_running_requests == 0:
            assert time.monotonic() < deadline, "the victim never ran requests"
            time.sleep(0.05)
        victim.popen.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            # Then the survivor alone serves until a whole round of the 8 clients' requests started after the
            # failover and ended, whatever the phase of their waves: every request held at SIGSTOP has ended.
            failed_over = frozen_at + DETECT_S + MARGIN_S
            deadline = failed_over + 60
            while min(last_start) <= failed_over:
                assert time.monotonic() < deadline, "the survivor did not serve a round of requests"
                time.sleep(0.1)
        finally:
            victim.popen.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        finished_before = requests_finished(victim)
        # The load goes on until the resumed worker has finished a request of its own again (3 s at most; the
        # rejoin is checked below either way).
        deadline = resumed_at + 3.0
        while requests_finished(victim) == finished_before and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        for f in futures:
            f.result()
    statuses = {status for *_, status, _ in results}
    assert statuses <= {"OK", "UNAVAILABLE"}, statuses
    held = [r for r in results if r[0] < frozen_at < r[1]]
    assert held, "no request was in flight when the worker froze"
    # While it stayed frozen, requests started after the failover went through the survivor.
    served = [r for r in results if r[0] > frozen_at + DETECT_S + MARGIN_S and r[1] < resumed_at
              and r[2] == "OK"]
    assert len(served) >= 4, f"only {len(served)} requests completed while the worker was frozen"
    # A held request ends within the detection time plus a margin, or, when it was on the survivor all along
    # or retried there (no token sent yet), within that plus one whole request's time on the survivor (on a
    # loaded CPU 150 tokens can take longer than the margin).
    on_survivor = max(end - start for start, end, *_ in served)
    limit = DETECT_S + MARGIN_S + on_survivor
    late = [r for r in held if r[1] > frozen_at + limit]
    assert not late, (f"{len(late)} of {len(held)} requests in flight at SIGSTOP ended "
                      f"{max(r[1] for r in late) - frozen_at:.1f} s after it (limit {limit:.1f} s)")
    print(f"{len(held)} requests in flight at SIGSTOP: all ended within "
          f"{max(r[1] for r in held) - frozen_at:.1f} s (a request on the survivor took up to "
          f"{on_survivor:.1f} s); {sum(r[2] == 'UNAVAILABLE' for r in results)} UNAVAILABLE in all")
    down = counters(stack.router, "pdserve_workers_down_total", "reason")
    assert down.get("missed_checks", 0) + down.get("stalled", 0) >= 1, down
    # After SIGCONT it rejoins by itself and holds nothing from the requests it was cut off from.
    deadline = time.monotonic() + 20
    while requests_finished(victim) == finished_before:
        assert time.monotonic() < deadline, "the resumed decode worker did not rejoin"
        assert one(address, [30, 31, 32], 4)[0] == "OK"
    for proc in (victim, survivor):
        idle = wait_idle(proc, 10)
        assert idle.num_free_pages == idle.num_total_pages and idle.num_transferring == 0, (proc.address, idle)


def test_a_request_waits_for_a_worker_to_be_back_within_its_deadline(stack):
    """Every decode worker is out of routing (both frozen): a request that arrives then waits for one, up to
    --wait-for-worker (5 s) and its deadline, instead of failing at once, and completes once they are back."""
    def missed_checks() -> float:
        return counters(stack.router, "pdserve_workers_down_total", "reason").get("missed_checks", 0)

    missed = missed_checks()  # (the stack is the module's: the test above counted its own)
    assert one(stack.router.address, [5, 6, 7], 4)[0] == "OK"
    for decode in stack.decode:
        decode.popen.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: missed_checks() >= missed + len(stack.decode), DETECT_S + MARGIN_S,
                   "the frozen decode workers to leave routing")
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(one, stack.router.address, [5, 6, 7, 8], 4, 30.0)
            time.sleep(1.5)
            assert not waiting.done(), f"the request did not wait for a worker: {waiting.result()}"
            for decode in stack.decode:
                decode.popen.send_signal(signal.SIGCONT)
            status, tokens, seconds = waiting.result(timeout=30)
    finally:
        for decode in stack.decode:
            decode.popen.send_signal(signal.SIGCONT)
    assert (status, tokens) == ("OK", 4) and 1.5 <= seconds < 5.0 + MARGIN_S, (status, tokens, seconds)
