"""Shared GPU timing for the benchmark scripts."""

from __future__ import annotations

import torch


def cuda_time(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]
