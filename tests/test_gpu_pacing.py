"""Pacing by GPU share, on a GPU: the replay clock reads a CUDA graph's own GPU time without a sync and sees another
process busy on the GPU; a decode worker with --gpu-share-while-prefilling and the GPU to itself holds nothing back.
(That it holds its steps back on a contended GPU is the serving benchmark's V3-slice rows: ITL and output tok/s with
and without --decode-gpu-share, benchmarks/results/README.md.)"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from golden import GREEDY  # noqa: E402
from decode_service.pacing import REPLAY_WINDOW, StepPacer  # noqa: E402
from decode_service.replay_clock import ReplayClock  # noqa: E402
from stack import hooks_env, metric, start_stack  # noqa: E402
from test_decode_pacing import a_then_b  # noqa: E402


_KEEP = []  # the captured graphs' inputs and outputs: a replay reads and writes their memory


def _captured_matmuls(n: int, repeat: int) -> torch.cuda.CUDAGraph:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            a @ b
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    x = a
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            x = torch.tanh(x @ b)
    _KEEP.extend((a, b, x))
    return graph


def test_the_replay_clock_reads_each_graph_s_own_gpu_time():
    small, large = _captured_matmuls(2048, 4), _captured_matmuls(4096, 8)
    synced = {}
    for name, graph in (("small", small), ("large", large)):  # host-timed around a sync: the reference
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        synced[name] = statistics.median(times)
    clock = ReplayClock()
    for _ in range(10):
        clock.replay("matmuls", 2048, small)
        clock.replay("matmuls", 4096, large)
    torch.cuda.synchronize()
    assert clock.take_launched() == pytest.approx(10 * sum(clock.fastest_s.values()))
    fastest = {name: clock.fastest_s[("matmuls", rows)] for name, rows in (("small", 2048), ("large", 4096))}
    for name in ("small", "large"):
        # The events bracket the kernels alone: no launch or sync overhead, so a little under the host's time.
        assert 0.5 * synced[name] <= fastest[name] <= 1.05 * synced[name], (name, fastest, synced)
    assert fastest["large"] > 4 * fastest["small"]  # 8x the flops and 2x the matmuls
    completed = clock.take_completed()  # each replay and its graph's fastest: near it with the GPU alone
    stretches = [seconds / fastest for seconds, fastest in completed]
    assert len(completed) == 20 and min(stretches) >= 1.0 and statistics.median(stretches) < 1.2, completed
    assert clock.take_completed() == []
    for _ in range(3):
        clock.replay("matmuls", 2048, small)
    assert clock.take_launched() == pytest.approx(3 * clock.fastest_s[("matmuls", 2048)])
    assert clock.take_launched() == 0.0  # taken
    # Scaled: each replay charged as the family's smallest timed graph with that many rows (or its largest).
    clock.replay("matmuls", 2048, small)
    assert clock.take_launched(scale=1.5) == pytest.approx(clock.fastest_s[("matmuls", 4096)])
    clock.replay("matmuls", 2048, small)
    assert clock.take_launched(scale=4.0) == pytest.approx(clock.fastest_s[("matmuls", 4096)])
    clock.replay("other", 2048, small)
    assert clock.take_launched() == 0.0  # another family: nothing timed yet when it was launched


# Another process keeping the GPU busy, as a prefill worker running 2048-token chunks of a large model does.
GPU_HOG = """
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
a @ a
torch.cuda.synchronize()
print("busy", flush=True)
while True:
    for _ in range(50):
        b = a @ a
    torch.cuda.synchronize()
"""


def _replays(clock: ReplayClock, graph: torch.cuda.CUDAGraph, n: int) -> list[tuple[float, float]]:
    for _ in range(n):
        clock.replay("matmuls", 8192, graph)
        time.sleep(0.002)  # as decode steps come: the stream idles between replays
    torch.cuda.synchronize()
    return clock.take_completed()


def test_the_replay_clock_sees_another_process_keeping_the_gpu_busy():
    """A graph of a few ms (a V3-slice decode step is 2-7 ms) runs at about its own speed alone (on an H200 the later
    replays 0.65-0.71 ms over the first few); with another process busy on the GPU, that process's time slices run
    inside the replays' events (8 ms over), and the pacer calls the GPU contended."""
    graph = _captured_matmuls(8192, 4)  # ~4 x 1.1 TFLOP
    clock = ReplayClock()
    _replays(clock, graph, 5)  # its fastest, alone
    alone, busy = StepPacer(gpu_share=1 / 3), StepPacer(gpu_share=1 / 3)
    alone.replays_completed(_replays(clock, graph, REPLAY_WINDOW))
    hog = subprocess.Popen([sys.executable, "-c", GPU_HOG], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "busy"
        busy.replays_completed(_replays(clock, graph, REPLAY_WINDOW))
    finally:
        hog.kill()
        hog.wait()
    means = {name: [sum(x) / len(p.replays) for x in zip(*p.replays)] for name, p in (("alone", alone), ("busy", busy))}
    assert not alone.contended and busy.contended, means  # (mean seconds, mean fastest) of each


@pytest.mark.slow
def test_a_decode_worker_with_the_gpu_to_itself_holds_nothing_back_for_a_prompt_on_its_way(tiny_v3_dir, tmp_path):
    """As the CPU test of --min-step-interval-ms (test_decode_pacing.py), with the GPU share instead (at 1/200, a
    tiny model's ~0.1 ms replays would space its steps ~20 ms): request A decodes alone, then B is reserved on the
    same decode worker with its KV held back 2 s. Nothing else uses the GPU, so the replays run at their fastest and
    A's tokens keep coming back to back: there is no prefill to make room for."""
    share, kv_delay_s = 0.005, 2.0
    stack = start_stack(tiny_v3_dir, tmp_path, engine_args=["--device", "cuda"],
                        decode_args=["--gpu-share-while-prefilling", str(share)],
                        decode_env=hooks_env(PDTEST_DECODE_SLOW_KV_ARRIVAL_S=kv_delay_s))
    try:
        # A's 1800 tokens (the model's context allows no more) take ~0.75 s at the H200's ~0.42 ms each: 0.15 s
        # alone leaves it decoding through the first half of B's wait (after 0.5 s alone it had finished once).
        run = a_then_b(stack, 1800, kv_delay_s, timeout_s=120, alone_s=0.15)
        held_s = metric(stack.decode[0].metrics_port, "pdserve_decode_step_hold_seconds_total")
        replays = metric(stack.decode[0].metrics_port, "pdserve_decode_replay_stretch_count")
    finally:
        stack.stop()
    assert len(run.a_ids) == 1800 and len(run.b_ids) == GREEDY.max_new_tokens
    assert len(run.alone) >= 10 and len(run.waiting) >= 10, (len(run.alone), len(run.waiting))
    assert replays > 100  # the worker timed its replays (the share is on)...
    assert statistics.median(run.waiting) < 2 * statistics.median(run.alone) and held_s < 0.2, \
        (run.alone[:20], run.waiting[:20])
