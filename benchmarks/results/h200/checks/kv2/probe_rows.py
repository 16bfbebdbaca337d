"""The one-GPU cuda_ipc copy on its own (no transport): the row-copy kernel (kv_transfer/row_copy.py) against the
torch path it replaces (gather_chunks + scatter_pages on a side stream) and a plain device copy of the same bytes,
for a 61-layer V3 room of 4k and 16k tokens into contiguous and shuffled pages, from rows in order and gathered
by slot. Device time by CUDA events (median of 20), host time of the call alone (median of 20, synchronised
before each). Run from the repository root on a GPU: python benchmarks/results/h200/checks/kv2/probe_rows.py"""
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from pdserve.kv_transfer import row_copy, token_slots  # noqa: E402
from pdserve.kv_transfer.pages import gather_chunks, plan_pages, scatter_pages  # noqa: E402

dev = torch.device("cuda:0")
torch.cuda.set_device(dev)
L, D, PS = 61, 576, 64
src_pool = torch.randn(L, 16384 + 4096, D, device=dev).to(torch.bfloat16)  # (layers, slots, kv_dim)
pool = torch.zeros(L, 16384 + 64, D, device=dev, dtype=torch.bfloat16)
stream = torch.cuda.Stream(dev)
row_copy.warm_up(dev, torch.bfloat16, D)


def timed(fn, n=20):
    dev_t, host_t = [], []
    for _ in range(n + 3):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host_t.append(time.perf_counter() - t0)
        b.record()
        torch.cuda.synchronize()
        dev_t.append(a.elapsed_time(b) / 1e3)
    return statistics.median(dev_t[3:]) * 1e3, statistics.median(host_t[3:]) * 1e6


for tokens in (4096, 16384):
    nbytes = L * tokens * D * 2
    src = src_pool[:, :tokens]
    flat = src.contiguous()
    dst = torch.empty_like(flat)
    ms, _ = timed(lambda: dst.copy_(flat))
    print(f"{tokens:6d} tokens {nbytes / 2**20:7.1f} MiB: plain device copy {ms:.3f} ms "
          f"({2 * nbytes / ms / 1e6:.0f} GB/s read+written)", flush=True)
    del dst
    slots = torch.randperm(src_pool.shape[1], generator=torch.Generator().manual_seed(0))[:tokens].to(dev)
    for order in ("contiguous", "shuffled"):
        pages = list(range(tokens // PS))
        if order == "shuffled":
            random.Random(tokens).shuffle(pages)
        dst_rows = token_slots(pages, tokens, PS).to(dev)
        plan = plan_pages(pages, tokens, PS, dev)
        for source, sl in (("rows in order", None), ("pool by slot", slots)):
            s = src if sl is None else src_pool

            def torch_path():
                chunks = gather_chunks(s, sl, 1)
                with torch.cuda.stream(stream):
                    for c in chunks:
                        stream.wait_event(c.ready)
                        scatter_pages(pool, c.rows, plan)
                        c.rows.record_stream(stream)
                done = torch.cuda.Event()
                done.record(stream)
                torch.cuda.current_stream().wait_event(done)  # (so the events above time it)

            def kernel():
                row_copy.copy_rows(pool, dst_rows, s, sl)
                done = torch.cuda.Event()
                done.record()

            t_ms, t_us = timed(torch_path)
            k_ms, k_us = timed(kernel)
            pool.zero_()
            kernel()
            expected = s[:, sl] if sl is not None else s
            same = torch.equal(pool[:, dst_rows], expected)
            print(f"   {order:10s} {source:13s} torch path {t_ms:.3f} ms device {t_us:6.1f} us host | "
                  f"kernel {k_ms:.3f} ms device {k_us:6.1f} us host ({2 * nbytes / k_ms / 1e6:.0f} GB/s) "
                  f"{'identical' if same else 'ROWS DIFFER'}", flush=True)

# The kernel's tile (tokens a program, warps) on the 16k room by slot into shuffled pages: what the defaults leave.
tokens = 16384
pages = list(range(tokens // PS))
random.Random(tokens).shuffle(pages)
dst_rows = token_slots(pages, tokens, PS).to(dev)
s = src_pool.view(torch.int64)
d = pool.view(torch.int64)
for block_t in (16, 32, 64, 128):
    for warps in (2, 4, 8):
        def run():
            row_copy._copy_rows_kernel[(-(-tokens // block_t), L)](
                s, slots, d, dst_rows, tokens, s.stride(0), s.stride(1), d.stride(0), d.stride(1), ROW_WORDS=144,
                SEG=16, BLOCK_T=block_t, INDEXED_SRC=True, num_warps=warps)
        ms, _ = timed(run)
        print(f"tile BLOCK_T={block_t:3d} num_warps={warps}: {ms:.3f} ms ({2 * L * tokens * D * 2 / ms / 1e6:.0f} GB/s)",
              flush=True)
