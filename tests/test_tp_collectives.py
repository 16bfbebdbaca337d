"""The tensor-parallel collectives, each against a plain torch reference, on two real Gloo ranks: this process
(rank 0) and a peer process (rank 1) that runs what it is told through a pipe and sends back what it got, so both
ranks' results are checked here. Shapes are ragged and not powers of two; the peer's buffers are poisoned first."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from multiprocessing import connection

import pytest
import torch

from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.parallel.group import TPGroup, connect, store_for
from pdserve.parallel.steps import ForwardCall, KVCall, move_kv, send_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PEER = r"""
import pickle, sys, torch
from multiprocessing import connection
from pdserve.parallel.group import connect, store_for
from pdserve.parallel.steps import KVCall, move_kv, receive_batch

conn = connection.Connection(int(sys.argv[2]))
send = lambda obj: conn.send_bytes(pickle.dumps(obj))  # plain pickle: tensors by value, not shared memory
group = connect(store_for(1, 2, int(sys.argv[1]), 30), 1, 2, "cpu", 30)
while True:
    op = conn.recv()
    if op is None:
        break
    kind, args = op
    if kind == "all_reduce":
        shape, dtype, seed = args
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        send(group.all_reduce(x))
    elif kind == "broadcast":
        shape, dtype = args
        send(group.broadcast(torch.full(shape, float("nan")).to(dtype)))
    elif kind == "batch":
        call, page_size, hidden = args
        batch, prev = receive_batch(group, call, torch.device("cpu"), page_size, hidden)
        send({k: v for k, v in vars(batch).items() if k != "layer_done"} | {"prev_hidden": prev})
    elif kind == "kv":
        call, shape, dtype, seed = args
        kv = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        move_kv(group, call, kv)
        send(kv)
"""


@pytest.fixture(scope="module")
def peer():
    """(this process's TPGroup as rank 0, the pipe to rank 1)."""
    store = store_for(0, 2, 0, 30)
    ours, theirs = connection.Pipe()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(store.port), str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    group = connect(store, 0, 2, "cpu", 30)
    yield group, ours
    ours.send(None)
    assert proc.wait(30) == 0


def received(conn):
    return pickle.loads(conn.recv_bytes())


SHAPES = [(1,), (7, 13), (3, 5, 129), (1000, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_sums_over_the_ranks(peer, dtype):
    group, conn = peer
    for i, shape in enumerate(SHAPES):
        seed = 10 * i
        conn.send(("all_reduce", (shape, dtype, seed)))
        mine = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        theirs = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        want = (mine.float() + theirs.float()).to(dtype)  # two addends: one rounding, the same in any order
        got = group.all_reduce(mine.clone())
        assert torch.equal(got, want), shape
        assert torch.equal(received(conn), want), f"rank 1, {shape}"


def test_all_reduce_at_size_1_returns_its_input():
    x = torch.randn(5, 3)
    assert TPGroup().all_reduce(x) is x and TPGroup().broadcast(x) is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.long])
def test_broadcast_gives_every_rank_rank_0s_tensor(peer, dtype):
    group, conn = peer
    for shape in SHAPES:
        conn.send(("broadcast", (shape, dtype)))
        x = (torch.randn(shape) * 100).to(dtype)
        assert torch.equal(group.broadcast(x.clone()), x)
        assert torch.equal(received(conn), x), shape


def _decode_batch(n: int, width: int) -> ForwardBatch:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 2048, (n,), generator=g)
    return ForwardBatch(ForwardMode.DECODE, ids, torch.randint(0, 99, (n,), generator=g),
                        torch.randint(0, 500, (n,), generator=g), 16,
                        page_table=torch.randint(0, 40, (n, width), generator=g),
                        seq_lens=torch.randint(1, 99, (n,), generator=g))


def _extend_batch() -> ForwardBatch:
    qo = [0, 5, 6, 13]
    n = qo[-1]
    return ForwardBatch(ForwardMode.EXTEND, torch.arange(n) * 7, torch.arange(n) + 3, torch.arange(n) + 100, 4,
                        qo_indptr=qo, prefix_lens=[0, 8, 3], page_tables=[[1, 2], [3, 4, 5], [6, 7, 8, 9]])


@pytest.mark.parametrize("batch, mtp", [(_decode_batch(5, 3), False), (_decode_batch(9, 7), True),
                                        (_extend_batch(), False), (_extend_batch(), True)])
def test_a_step_reaches_the_other_rank_as_rank_0_built_it(peer, batch, mtp):
    """ForwardCall through the pipe plus send_batch/receive_batch: the peer's batch (and prev_hidden) equal this
    one's, field for field."""
    group, conn = peer
    hidden = 11
    prev = torch.randn(batch.num_tokens, hidden).to(torch.bfloat16) if mtp else None
    call = ForwardCall.of(batch, prev, depth=0)
    conn.send(("batch", (call, batch.page_size, hidden)))
    send_batch(group, batch, prev)
    got = received(conn)
    for key, want in vars(batch).items():
        if key == "layer_done":
            continue
        if isinstance(want, torch.Tensor):
            assert torch.equal(got[key], want), key
        else:
            assert got[key] == want, key
    assert (got["prev_hidden"] is None) if prev is None else torch.equal(got["prev_hidden"], prev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("src, dst", [(0, None), (0, 1), (1, 0)], ids=["tp-share", "dp-to-rank1", "dp-to-rank0"])
def test_kv_rows_move_between_the_ranks_pools(peer, dtype, src, dst):
    """move_kv: every layer's rows at the source slots of rank src's pool, in any order, land in the destination
    slots of rank dst's pool (dst None: the same slots of every rank: a decode worker's transfers handed on under TP;
    DP attention moves a request's rows from one rank's pages to another's), and nothing else changes anywhere."""
    group, conn = peer
    shape, n, seed = (3, 50, 9), 13, 7
    pools = [torch.randn(shape, generator=torch.Generator().manual_seed(seed + r)).to(dtype) for r in (0, 1)]
    before = [p.clone() for p in pools]
    order = torch.randperm(shape[1], generator=torch.Generator().manual_seed(n))
    src_slots = order[:n]
    dst_slots = src_slots if dst is None else order[n:2 * n]
    call = KVCall(n, src, dst)
    conn.send(("kv", (call, shape, dtype, seed)))
    move_kv(group, call, pools[0], torch.stack([src_slots, dst_slots]))
    got = [pools[0], received(conn)]
    for r in (0, 1):
        want = before[r].clone()
        if r != src and dst in (None, r):
            want[:, dst_slots] = before[src][:, src_slots]
        assert torch.equal(got[r], want), r
