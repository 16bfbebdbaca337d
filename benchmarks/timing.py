"""Shared GPU timing and result writing for the benchmark scripts."""

from __future__ import annotations

import json
import os

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


def copy_bandwidth(iters: int = 20, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of `nbytes`: bytes read + written per second (the read floors' bandwidth)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / cuda_time(lambda: y.copy_(x), iters, 3)


def write_json(path: str, result: dict) -> None:
    """Write a benchmark's results to `path` (creating its folder) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
