"""The host side of the "flashinfer" backend on the CPU: the page indices and lengths we plan, the empty-row
contract, and FlashInferGraphPlan's per-graph plans (groups, offsets, replan), against the torch reference.

FlashInfer itself needs a GPU, so `flashinfer.mla.BatchMLAPagedAttentionWrapper` is replaced by a torch model of
its documented contract: plan() takes (qo_indptr, kv_indptr, kv_indices, kv_len_arr) and, built with
use_cuda_graph, copies them into the fixed buffers it was given; run() attends over exactly the pages and lengths
planned. Rows without keys get NaN (FlashInfer leaves them unspecified), so our zeroing is checked too. The real
kernels are checked on the GPU (tests/test_gpu_attention.py, tests/test_gpu_flashinfer_graphs.py)."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.kernels import flashinfer_attention as fa
from pdserve.kernels.attention import TorchAttention

RANK, ROPE, HEADS, PAGE = 512, 64, 4, 16


class FakeMLAWrapper:
    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        self.graph = use_cuda_graph
        self.bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        assert (num_heads, head_dim_ckv, head_dim_kpe, causal) == (HEADS, RANK, ROPE, False)
        self.plans += 1
        if self.graph:  # as FlashInfer: into the buffers a captured kernel reads
            q, kp, ki, kl = self.bufs
            q.copy_(qo_indptr), kp.copy_(kv_indptr), ki[: len(kv_indices)].copy_(kv_indices), kl.copy_(kv_len_arr)
        else:
            self.bufs = tuple(t.clone() for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr))
        self.sm_scale = sm_scale

    def run(self, q_nope, q_pe, ckv, kpe, out=None):
        qo_indptr, kv_indptr, kv_indices, kv_len = self.bufs
        assert torch.equal(qo_indptr.long(), torch.arange(q_nope.shape[0] + 1)), "one query row per request"
        res = torch.full_like(q_nope, float("nan"))
        for b in range(q_nope.shape[0]):
            pages, n = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long(), int(kv_len[b])
            assert len(pages) == -(-n // PAGE), "planned pages must cover exactly the row's length"
            if n:
                c = ckv[pages].reshape(-1, RANK)[:n].float()
                k = kpe[pages].reshape(-1, ROPE)[:n].float()
                scores = (q_nope[b].float() @ c.T + q_pe[b].float() @ k.T) * self.sm_scale
                res[b] = (torch.softmax(scores, -1) @ c).to(res.dtype)
        return res


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(fa, "flashinfer", types.SimpleNamespace(mla=types.SimpleNamespace(
        BatchMLAPagedAttentionWrapper=FakeMLAWrapper)))
    monkeypatch.setattr(fa, "default_mla_backend", lambda device: "fa2")
    return fa.FlashInferAttention()


def inputs(batch, lens, seed, width=6, num_pages=40):
    gen = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(batch, HEADS, RANK, generator=gen)
    q_pe = torch.randn(batch, HEADS, ROPE, generator=gen)
    kv = torch.randn(num_pages * PAGE, RANK + ROPE, generator=gen) * 0.5
    table = torch.randperm(num_pages, generator=gen)[: batch * width].view(batch, width)  # scattered pages
    return q_lat, q_pe, kv, table, torch.tensor(lens)


def reference(q_lat, q_pe, kv, table, lens):
    # FlashInfer computes in bf16: the reference sees the same rounded inputs.
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    return TorchAttention().mla_decode(r(q_lat), r(q_pe), r(kv), table, lens, PAGE, 0.1)


def close(out, ref):
    return torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_eager_plans_follow_the_batch(backend):
    """Every step plans again, for whatever batch it brings (the sizes change between decode and verification)."""
    for batch, lens, seed in ((1, [37], 0), (3, [1, 90, 16], 1), (2, [0, 33], 2), (3, [5, 6, 7], 3)):
        q_lat, q_pe, kv, table, seq_lens = inputs(batch, lens, seed)
        out = backend.mla_decode(q_lat, q_pe, kv, table, seq_lens, PAGE, 0.1)
        ref = reference(q_lat, q_pe, kv, table, seq_lens)
        empty = seq_lens == 0
        assert out.dtype == q_lat.dtype and not out.isnan().any()
        assert (out[empty] == 0).all(), "a row without keys must be 0"
        assert close(out[~empty], ref[~empty]), f"batch {batch}"


def test_graph_plan_replans_each_group_from_host_inputs(backend):
    """A draft chain attends with lens, then lens + 1 (a new tensor): one plan each. The capture plans nothing;
    replan(page_table, seq_lens) sets every group from the graph's host inputs, with its offset."""
    rows, width = 3, 6
    plan = backend.graph_plan(rows, width)
    q_lat, q_pe, kv, table, lens = inputs(rows, [4, 40, 17], 0, width)
    with plan.forward(capturing=False):
        first = backend.mla_decode(q_lat, q_pe, kv, table, lens, PAGE, 0.1)
        backend.mla_decode(q_lat, q_pe, kv, table, lens, PAGE, 0.1)  # another layer: same group
        backend.mla_decode(q_lat, q_pe, kv, table, lens + 1, PAGE, 0.1)
    assert plan.num_plans == 2
    assert close(first, reference(q_lat, q_pe, kv, table, lens))
    assert backend._graph_plan is None, "the bracket must not outlive the forward"

    new_table, new_lens = inputs(rows, [70, 1, 31], 5, width)[3:]
    plan.replan(new_table, new_lens)  # host tensors, as DecodeGraphRunner.replay_packed passes them
    wrappers = [d._wrapper for d in plan._decodes]
    before = [w.plans for w in wrappers]
    with plan.forward(capturing=True):  # what a replay runs: the captured kernels on the replanned buffers
        # the capture passes its own (static) tensors: their values do not matter any more
        step0 = backend.mla_decode(q_lat, q_pe, kv, table, lens, PAGE, 0.1)
        step1 = backend.mla_decode(q_lat, q_pe, kv, table, lens + 1, PAGE, 0.1)
    assert [w.plans for w in wrappers] == before, "nothing may plan inside a capture"
    assert close(step0, reference(q_lat, q_pe, kv, new_table, new_lens))
    assert close(step1, reference(q_lat, q_pe, kv, new_table, new_lens + 1))
