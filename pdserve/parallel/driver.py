"""Rank 0's handle on the model of a tensor-parallel worker: what its ModelRunner calls in place of the model.

Each entry point first hands the call and its batch to the other ranks (pdserve.parallel.steps), then runs it here;
the other ranks run the same forward (pdserve.parallel.worker), so the layers' collectives meet. They compute no
logits: lm_head is replicated and only rank 0 samples.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from pdserve.forward_batch import ForwardBatch
from pdserve.parallel import dp_attention
from pdserve.parallel.ranks import Ranks
from pdserve.parallel.steps import ForwardCall, KVCall, ReplayCall, move_kv, send_batch, send_graph_inputs


class Driver:
    def __init__(self, model, ranks: Ranks, dp_size: int = 1):
        """dp_size: ranks with requests of their own (DP attention: every rank; 1 under plain TP)."""
        self.model, self.ranks, self.dp_size = model, ranks, dp_size
        self.cfg, self.kernels = model.cfg, model.kernels

    @property
    def has_mtp_weights(self) -> bool:
        return self.model.has_mtp_weights

    def __call__(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        with self.ranks.guard():
            self.ranks.announce(ForwardCall.of(batch))
            send_batch(self.ranks.group, batch, None)
            if batch.dp_ranks is None:
                return self.model(batch, kv_cache)
            local, _, restore = dp_attention.split(batch, batch.dp_ranks, self.ranks.group)
            return self.model(local, kv_cache)[restore]  # every rank's rows, in the batch's order

    def mtp_forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, kv_cache: torch.Tensor, depth: int = 0,
                    logits: bool = True):
        if not self.model.has_mtp_weights:  # its error, with nothing announced
            return self.model.mtp_forward(batch, prev_hidden, kv_cache, depth, logits)
        with self.ranks.guard():
            self.ranks.announce(ForwardCall.of(batch, prev_hidden, depth))
            send_batch(self.ranks.group, batch, prev_hidden)
            if batch.dp_ranks is None:
                return self.model.mtp_forward(batch, prev_hidden, kv_cache, depth, logits)
            local, prev, restore = dp_attention.split(batch, batch.dp_ranks, self.ranks.group, prev_hidden)
            draft, h = self.model.mtp_forward(local, prev, kv_cache, depth, logits)
            return (None if draft is None else draft[restore]), h[restore]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def share_kv(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Latent KV that reached rank 0's pool `kv` from elsewhere (a transfer), at `slots` of every layer, into the
        other ranks' pools: under TP each rank attends over its own copy."""
        slots = slots.to(kv.device)
        self._move(KVCall(len(slots)), kv, torch.stack([slots, slots]))

    def move_kv(self, kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, src: int, dst: int) -> None:
        """DP attention: rows of every layer at `src_slots` of rank `src`'s pool into `dst_slots` of rank `dst`'s (rank
        0's pool is `kv`)."""
        self._move(KVCall(len(src_slots), src, dst), kv, torch.stack([src_slots, dst_slots]).to(kv.device))

    def _move(self, call: KVCall, kv: torch.Tensor, slots: torch.Tensor) -> None:
        with self.ranks.guard():
            self.ranks.announce(call)
            move_kv(self.ranks.group, call, kv, slots)

    def share_blocks(self, rows: int, width: int) -> Callable[[torch.Tensor], None]:
        """DP attention: the `share` to give DecodeGraphRunner.replay_ranks (every rank's inputs of a step to the
        other ranks, each of which replays its own graph of bucket `rows`)."""
        def share(blocks: torch.Tensor) -> None:
            with self.ranks.guard():
                self.ranks.announce(ReplayCall(False, False, rows, width, self.ranks.group.size))
                self.ranks.group.broadcast(blocks)

        return share

    def replay_patch(self, graphs, rows: int, width: int, chain: bool,
                     patch: Optional[Callable[[torch.Tensor], None]]) -> Callable[[torch.Tensor], None]:
        """The patch to give DecodeGraphRunner.replay_packed for a replay every rank makes: it runs once the graph's
        inputs are filled (after `patch`, which edits the token ids on the device), so it hands the other ranks
        exactly what rank 0's graph is about to read; each then replays its own graph of the same bucket."""
        graph = graphs.graphs[rows]

        def patch_then_share(input_ids: torch.Tensor) -> None:
            if patch is not None:
                patch(input_ids)
            with self.ranks.guard():
                self.ranks.announce(ReplayCall(graphs.mtp, chain, rows, width))
                send_graph_inputs(self.ranks.group, graph, width)

        return patch_then_share


__all__ = ["Driver"]
