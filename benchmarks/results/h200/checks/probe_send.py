"""Host cost of each piece of a cuda_ipc room send on one GPU (no transport): where send()'s 0.55 ms goes."""
import statistics, time, sys, os
import torch
sys.path.insert(0, os.getcwd())
from pdserve.kv_transfer.pages import gather_chunks, plan_pages, scatter_pages
dev = torch.device("cuda:0")
rows = torch.randn(61, 16384, 576, device=dev).to(torch.bfloat16)
pool = torch.zeros(61, 8192, 576, device=dev, dtype=torch.bfloat16)
stream = torch.cuda.Stream(dev)
def timeit(name, fn, n=20):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"{name:50s} host {statistics.median(ts)*1e6:8.1f} us (max {max(ts)*1e6:8.1f})", flush=True)
src = rows[:61, :4096]
timeit("gather_chunks(view, None, 1)", lambda: gather_chunks(src, None, 1))
timeit("src.contiguous() clone", lambda: src.contiguous())
keep = []
timeit("gather_chunks kept (no free)", lambda: keep.append(gather_chunks(src, None, 1)), n=3)
keep.clear()
pages = list(range(64))
timeit("plan_pages contiguous", lambda: plan_pages(pages, 4096, 64, dev))
import random; sh = pages[:]; random.Random(1).shuffle(sh)
timeit("plan_pages shuffled", lambda: plan_pages(sh, 4096, 64, dev))
c = gather_chunks(src, None, 1)[0]
p1 = plan_pages(pages, 4096, 64, dev); p2 = plan_pages(sh, 4096, 64, dev)
timeit("scatter_pages contiguous", lambda: scatter_pages(pool, c.rows, p1))
timeit("scatter_pages shuffled", lambda: scatter_pages(pool, c.rows, p2))
def on_stream():
    with torch.cuda.stream(stream):
        stream.wait_event(c.ready); scatter_pages(pool, c.rows, p1); c.rows.record_stream(stream)
    e = torch.cuda.Event(); e.record(stream)
timeit("stream+wait+scatter+record_stream+event", on_stream)
def whole():
    cs = gather_chunks(src, None, 1)
    with torch.cuda.stream(stream):
        for ch in cs:
            stream.wait_event(ch.ready); scatter_pages(pool, ch.rows, p1); ch.rows.record_stream(stream)
    e = torch.cuda.Event(); e.record(stream)
timeit("gather + scatter on stream (a send)", whole)
t0 = time.perf_counter(); whole(); torch.cuda.synchronize(); print("send + device", (time.perf_counter()-t0)*1e3, "ms")
from pdserve.common.trace import mark
timeit("mark() x1", lambda: mark("kv.x", "room1"))
