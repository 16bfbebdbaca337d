"""DP attention: attention data-parallel over requests, the MLP / MoE still tensor- (or expert-) parallel.

MLA caches one latent head per token, so under TP every rank holds the same latent KV of every request: N GPUs,
one pool's worth of tokens. With DP attention each request lives on one rank (the scheduler's choice, see
pdserve.scheduler): that rank alone runs its attention (q/kv/o projections replicated) over its own pool, so the
worker holds N pools' worth of tokens. Per layer (SGLang's --enable-dp-attention):

    x_r = x_r + MLA(norm(x_r))                    each rank its own requests' tokens (none at all is fine)
    h   = all_gather(norm(x_r))                   every rank's tokens, padded to the largest count
    x_r = x_r + slice_r(MLP(h))                   the TP / EP MLP over all tokens, this rank's rows back

and after the last layer the hidden states of all tokens are gathered again, so rank 0 samples every request.
Every rank runs every collective of every layer in every step, with or without tokens of its own (padding).

Rank 0 hands every rank the whole step (pdserve.parallel.steps, with each sequence's DP rank); each rank cuts its
own part out with `split`, so rank 0 and the others build their local batches with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.parallel.group import TPGroup


@dataclass(frozen=True)
class DPLayout:
    """One step's tokens over the DP ranks: `counts[r]` tokens of rank r, laid out rank after rank when gathered."""

    group: TPGroup
    counts: tuple[int, ...]

    @property
    def offset(self) -> int:
        return sum(self.counts[:self.group.rank])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows (counts[rank], D) -> every rank's (sum(counts), D), rank after rank."""
        most = max(self.counts)
        padded = x.new_zeros(most, *x.shape[1:])  # (max count, D): the collective takes one shape from all ranks
        padded[:x.shape[0]] = x
        stacked = self.group.all_gather(padded)  # (ranks, max count, D)
        return torch.cat([stacked[r, :n] for r, n in enumerate(self.counts)])

    def slice(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (sum(counts), D) -> this rank's."""
        return y[self.offset:self.offset + self.counts[self.group.rank]]


def token_ranks(batch: ForwardBatch, dp_ranks: Sequence[int]) -> list[int]:
    """The DP rank of every token of `batch` (dp_ranks: one per sequence; a DECODE row is a sequence)."""
    if batch.mode is ForwardMode.DECODE:
        return list(dp_ranks)
    q = batch.qo_indptr
    return [r for i, r in enumerate(dp_ranks) for _ in range(q[i + 1] - q[i])]


def split(batch: ForwardBatch, dp_ranks: Sequence[int], group: TPGroup,
          prev_hidden: Optional[torch.Tensor] = None) -> tuple[ForwardBatch, Optional[torch.Tensor], torch.Tensor]:
    """This rank's part of the whole step `batch`: (its batch, carrying the DPLayout; its rows of prev_hidden; the
    index that puts the gathered rows (rank after rank) back into `batch`'s row order)."""
    per_token = token_ranks(batch, dp_ranks)
    counts = tuple(per_token.count(r) for r in range(group.size))
    rows = [[] for _ in range(group.size)]
    for i, r in enumerate(per_token):
        rows[r].append(i)
    dev = batch.input_ids.device
    mine = torch.tensor(rows[group.rank], dtype=torch.long, device=dev)
    gathered_order = torch.tensor([i for r in rows for i in r], dtype=torch.long)
    restore = torch.empty_like(gathered_order)
    restore[gathered_order] = torch.arange(len(gathered_order))  # global row i sits at gathered row restore[i]
    layout = DPLayout(group, counts)
    common = dict(input_ids=batch.input_ids[mine], positions=batch.positions[mine], out_slots=batch.out_slots[mine],
                  layer_done=batch.layer_done, dp_ranks=None, dp=layout)
    if batch.mode is ForwardMode.DECODE:
        local = replace(batch, page_table=batch.page_table[mine], seq_lens=batch.seq_lens[mine], **common)
    else:
        seqs = [i for i, r in enumerate(dp_ranks) if r == group.rank]
        q = batch.qo_indptr
        indptr = [0]
        for i in seqs:
            indptr.append(indptr[-1] + q[i + 1] - q[i])
        local = replace(batch, qo_indptr=indptr, prefix_lens=[batch.prefix_lens[i] for i in seqs],
                        page_tables=[batch.page_tables[i] for i in seqs], **common)
    prev = None if prev_hidden is None else prev_hidden[mine]
    return local, prev, restore.to(dev)


__all__ = ["DPLayout", "split", "token_ranks"]
