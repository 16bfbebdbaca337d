"""What rank 0 hands the other ranks of a tensor-parallel worker, once per model call: a small header through
each rank's pipe (which call, and the batch's host-side shape) and the batch's tensors through one broadcast. Also
latent KV moved between the ranks' pools (a decode worker's transfers land in rank 0's: `KVCall`).

Only inputs travel, never a decision a rank could take differently: token ids (after any device-side patch:
overlap scheduling's and speculation's tokens exist on rank 0's device only), positions, KV slots, page tables,
and the MTP layer's previous hidden states. Every rank then runs the same forward, collectives included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.parallel.group import TPGroup


@dataclass(frozen=True)
class ForwardCall:
    """An eager model call: `model(batch)` or, with mtp, `model.mtp_forward(batch, prev_hidden, depth=depth)`.
    The batch's tensors follow as one int64 broadcast (ids, positions, slots, then for DECODE seq_lens and the page
    table, `width` pages wide), then prev_hidden (num_tokens, D) for mtp."""

    mtp: bool
    mode: ForwardMode
    num_tokens: int
    width: int = 0  # DECODE: page-table columns
    qo_indptr: Optional[tuple[int, ...]] = None  # EXTEND
    prefix_lens: Optional[tuple[int, ...]] = None
    page_tables: Optional[tuple[tuple[int, ...], ...]] = None
    hidden_dtype: Optional[torch.dtype] = None  # mtp: prev_hidden's
    depth: int = 0
    dp_ranks: Optional[tuple[int, ...]] = None  # DP attention: each sequence's rank (pdserve.parallel.dp_attention)

    @classmethod
    def of(cls, batch: ForwardBatch, prev_hidden: Optional[torch.Tensor] = None, depth: int = 0) -> "ForwardCall":
        dp = None if batch.dp_ranks is None else tuple(batch.dp_ranks)
        if batch.mode is ForwardMode.EXTEND:
            return cls(prev_hidden is not None, batch.mode, batch.num_tokens, 0, tuple(batch.qo_indptr),
                       tuple(batch.prefix_lens), tuple(map(tuple, batch.page_tables)),
                       None if prev_hidden is None else prev_hidden.dtype, depth, dp)
        return cls(prev_hidden is not None, batch.mode, batch.num_tokens, batch.page_table.shape[1],
                   hidden_dtype=None if prev_hidden is None else prev_hidden.dtype, depth=depth, dp_ranks=dp)


@dataclass(frozen=True)
class ReplayCall:
    """A captured CUDA graph replay: the graph of bucket `rows` of the target (or, with mtp, the MTP layer's) runner,
    its draft chain with chain. Its static inputs follow as one int64 broadcast (header (4, rows), then the page
    table's first `width` columns), then, for mtp graphs, prev_hidden (rows, D). Under DP attention (`ranks` > 1)
    the broadcast holds one such block per rank, rank after rank, and each rank fills its graph from its own."""

    mtp: bool
    chain: bool
    rows: int
    width: int
    ranks: int = 1


@dataclass(frozen=True)
class KVCall:
    """Latent KV rows moved between the ranks' pools outside the model, `num_slots` slots of every layer, from rank
    `src` to rank `dst`, or with dst None from rank 0 into the same slots of every rank (under TP each rank attends
    over its own copy of what a prefill worker's transfer put into rank 0's pool). Under DP attention a request's KV
    lives on one rank: a transfer lands in rank 0's pool and moves to the rank the request was placed on. Rank 0's
    slots (int64, (2, num_slots): source, destination) follow as one broadcast, then rank src's rows (layers,
    num_slots, kv_dim) as another."""

    num_slots: int
    src: int = 0
    dst: Optional[int] = None


def move_kv(tp: TPGroup, call: KVCall, kv: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
    """Every rank's part of `call` on its pool `kv` (layers, pool slots, kv_dim): rank 0 passes `slots` (2,
    num_slots) (source, destination; one row of both for dst None), on kv's device; the others None."""
    if slots is None:
        slots = torch.empty(2, call.num_slots, dtype=torch.long, device=kv.device)
    tp.broadcast(slots)
    if tp.rank == call.src:
        rows = kv.index_select(1, slots[0])  # (layers, n, kv_dim)
    else:
        rows = torch.empty(kv.shape[0], call.num_slots, kv.shape[2], dtype=kv.dtype, device=kv.device)
    tp.broadcast(rows, src=call.src)
    if tp.rank != call.src and call.dst in (None, tp.rank):
        kv.index_copy_(1, slots[1], rows)


def send_batch(tp: TPGroup, batch: ForwardBatch, prev_hidden: Optional[torch.Tensor]) -> None:
    """Rank 0: the tensors of a ForwardCall's batch."""
    parts = [batch.input_ids, batch.positions, batch.out_slots]
    if batch.mode is ForwardMode.DECODE:
        parts += [batch.seq_lens, batch.page_table.reshape(-1)]
    tp.broadcast(torch.cat(parts))
    if prev_hidden is not None:
        tp.broadcast(prev_hidden.contiguous())


def receive_batch(tp: TPGroup, call: ForwardCall, device: torch.device, page_size: int, hidden_size: int
                  ) -> tuple[ForwardBatch, Optional[torch.Tensor]]:
    """Ranks 1..: the batch (and prev_hidden) rank 0 sent for `call`."""
    n = call.num_tokens
    decode = call.mode is ForwardMode.DECODE
    buf = tp.broadcast(torch.empty(n * (4 + call.width) if decode else 3 * n, dtype=torch.long, device=device))
    prev = None
    if call.mtp:
        prev = tp.broadcast(torch.empty(n, hidden_size, dtype=call.hidden_dtype, device=device))
    dp = None if call.dp_ranks is None else list(call.dp_ranks)
    if decode:
        batch = ForwardBatch(ForwardMode.DECODE, buf[:n], buf[n:2 * n], buf[2 * n:3 * n], page_size,
                             page_table=buf[4 * n:].view(n, call.width), seq_lens=buf[3 * n:4 * n], dp_ranks=dp)
    else:
        batch = ForwardBatch(ForwardMode.EXTEND, buf[:n], buf[n:2 * n], buf[2 * n:], page_size,
                             qo_indptr=list(call.qo_indptr), prefix_lens=list(call.prefix_lens),
                             page_tables=[list(p) for p in call.page_tables], dp_ranks=dp)
    return batch, prev


def send_graph_inputs(tp: TPGroup, graph, width: int) -> None:
    """Rank 0: a graph's static inputs, as filled (and patched) for its replay (pdserve.cuda_graph._Graph)."""
    tp.broadcast(torch.cat([graph.header.reshape(-1), graph.page_table[:, :width].reshape(-1)]))
    if graph.prev_hidden is not None:
        tp.broadcast(graph.prev_hidden)


def receive_graph_inputs(tp: TPGroup, call: ReplayCall, graph) -> None:
    """Ranks 1..: rank 0's inputs into this rank's graph of the same bucket, as _Graph.fill_packed leaves them."""
    block = call.rows * (4 + call.width)
    buf = tp.broadcast(torch.empty(call.ranks * block, dtype=torch.long, device=graph.header.device))
    graph.fill_block(buf.view(call.ranks, block)[tp.rank if call.ranks > 1 else 0], call.width)
    if graph.prev_hidden is not None:
        tp.broadcast(graph.prev_hidden)


__all__ = ["ForwardCall", "ReplayCall", "KVCall", "move_kv", "send_batch", "receive_batch", "send_graph_inputs",
           "receive_graph_inputs"]
