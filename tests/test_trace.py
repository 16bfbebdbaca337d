"""PDSERVE_TRACE: every process of a stack records when each request passes its points, and
benchmarks/trace_report.py lines them up (pdserve/common/trace.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from golden import GREEDY, PROMPTS
from pdserve.common import trace
from stack import generate, start_stack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.trace_report import cadence, load, report, ttft_parts  # noqa: E402

# Where each request must pass, in this order (the Bind and the decode worker's Reserve run beside the prefill;
# the prefill worker's answer and the decode worker's first token race to the router).
IN_ORDER = ["router.recv", "router.routed", "prefill.recv", "prefill.queued", "prefill.layer0_done",
            "prefill.sampled", "prefill.answer", "router.prefill_answer"]
AFTER = {"decode.reserve": "router.routed", "router.reserved": "decode.reserve", "prefill.bind": "router.reserved",
         "decode.kv_arrived": "prefill.sampled", "decode.first_output": "decode.kv_arrived",
         "router.decode_first": "decode.first_output", "prefill.handed_over": "prefill.sampled",
         "prefill.transfer_confirmed": "prefill.handed_over"}


def test_off_it_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "FOLDER", None)
    trace.mark("router.recv", "r1")
    assert not list(tmp_path.iterdir())


def test_cadence_groups_a_steps_prompts_and_times_the_steps_apart():
    ms = 1_000_000
    requests = {  # step 1: a and b (sampled 50 us apart); step 2: c; step 3: d, whose layer 0 came before step 2 ended
        "a": {"prefill.layer0_done": 2 * ms, "prefill.sampled": 30 * ms},
        "b": {"prefill.layer0_done": 2 * ms, "prefill.sampled": 30 * ms + 50_000},
        "c": {"prefill.layer0_done": 33 * ms, "prefill.sampled": 60 * ms + 50_000},
        "d": {"prefill.layer0_done": 59 * ms, "prefill.sampled": 90 * ms + 50_000},
        "never sampled": {"prefill.queued": 1 * ms},
    }
    steps = cadence(requests)
    assert steps["steps"] == 3 and steps["prompts_per_step"] == 4 / 3
    assert steps["interval"]["n"] == 2 and steps["interval"]["median_ms"] == pytest.approx(30.0)
    # c's first layer 2.95 ms after step 1's last sampling; d's was launched before step 2's ended: not counted.
    assert steps["to_next_layer0"]["n"] == 1 and steps["to_next_layer0"]["median_ms"] == pytest.approx(2.95)
    assert cadence({"a": requests["a"]}) == {}


def test_ttft_parts_split_each_first_token_of_a_window_and_take_medians_of_its_own_differences():
    ms = 1_000_000

    def first_token(recv: int, queued: float, sampled: float, out: float) -> dict:
        return {"router.recv": recv, "prefill.queued": recv + int(queued * ms),
                "prefill.sampled": recv + int(sampled * ms), "router.first_out": recv + int(out * ms)}

    requests = {"a": first_token(100 * ms, 1, 15, 16), "b": first_token(200 * ms, 2, 14, 16),
                "c": first_token(300 * ms, 1, 13, 15),
                "ended by its first token": {"router.recv": 250 * ms, "prefill.queued": 251 * ms},
                "before the window": first_token(10 * ms, 9, 99, 100)}
    parts = ttft_parts(requests, since_ns=50 * ms, until_ns=400 * ms)
    assert parts["requests"] == 3
    assert parts["to_prefill_engine_ms"] == pytest.approx(1) and parts["prefill_step_ms"] == pytest.approx(12)
    assert parts["to_router_send_ms"] == pytest.approx(2) and parts["router_send_ms"] == pytest.approx(16)
    assert ttft_parts(requests)["requests"] == 4  # no window: every complete one
    assert ttft_parts(requests, since_ns=500 * ms) is None


@pytest.mark.slow
def test_a_traced_stack_records_every_point_of_every_request_in_order(tiny_v3_dir, tmp_path, monkeypatch):
    folder = tmp_path / "trace"
    monkeypatch.setenv("PDSERVE_TRACE", str(folder))
    stack = start_stack(tiny_v3_dir, tmp_path)
    try:
        for prompt in PROMPTS[:3]:
            generate(stack.router.address, prompt, GREEDY)
    finally:
        stack.stop()
    assert len(list(folder.glob("*.trace"))) == 3  # router, prefill and decode processes
    requests = {rid: ev for rid, ev in load(str(folder)).items() if "router.recv" in ev}
    assert len(requests) == 3
    for rid, events in requests.items():
        assert set(IN_ORDER) | set(AFTER) | {"router.first_out"} <= set(events), (rid, sorted(events))
        times = [events[e] for e in IN_ORDER]
        assert times == sorted(times), (rid, sorted(events.items(), key=lambda kv: kv[1]))
        for event, before in AFTER.items():
            assert events[event] >= events[before], (rid, event, before)
        # The first token goes out with whichever came first.
        assert events["router.first_out"] >= min(events["router.prefill_answer"], events["router.decode_first"])
    # Each KV room (the requests' and the stack's own warm-up's), under its own id: the prefill side's points and
    # the decode side's, in order.
    rooms = {rid: ev for rid, ev in load(str(folder)).items() if rid.startswith("room")}
    assert len(rooms) >= 3, sorted(rooms)
    for rid, events in rooms.items():
        order = ["kv.send", "kv.send_returned", "kv.finish_returned", "kv.drained", "kv.aux_written", "kv.recv_aux",
                 "kv.landed", "kv.done_read"]
        assert set(order) <= set(events), (rid, sorted(events))
        # Each side's points in order, and each message read after it was sent: drained before the AUX's write
        # (its mark comes after the write returns, so the decode side may read the AUX first), landed before the
        # confirmation is read.
        chains = (["kv.send", "kv.send_returned", "kv.drained", "kv.aux_written"], ["kv.recv_aux", "kv.landed"],
                  ["kv.drained", "kv.recv_aux"], ["kv.landed", "kv.done_read"])
        for chain in chains:
            times = [events[e] for e in chain]
            assert times == sorted(times), (rid, chain, sorted(events.items(), key=lambda kv: kv[1]))
    assert report(rooms, origin="kv.send")[0]["event"] == "kv.send"
    rows = report(requests)
    assert rows[0]["event"] == "router.recv" and rows[0]["median_ms"] == rows[0]["max_ms"] == 0
    assert all(r["median_ms"] <= r["max_ms"] for r in rows)
    assert {r["event"] for r in rows} == set(IN_ORDER) | set(AFTER) | {"router.first_out"}
    assert all(r["requests"] == 3 for r in rows)
