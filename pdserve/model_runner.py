"""Turns a SchedulerOutput into model forwards: builds the ForwardBatch tensors, runs the model over the latent
KV pool, and returns the last hidden state and logits of every row that samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.kv_cache import LatentKVPool
from pdserve.model import DeepseekV3
from pdserve.request import Request
from pdserve.scheduler import PrefillChunk, SchedulerOutput


@dataclass
class ForwardOutput:
    requests: list[Request]  # the requests that sample this step, in row order
    logits: torch.Tensor  # (rows, vocab) fp32
    hidden: torch.Tensor  # (rows, D): last hidden state before the final norm (NextN's input)


class ModelRunner:
    def __init__(self, model: DeepseekV3, pool: LatentKVPool, device: torch.device):
        self.model, self.pool, self.device = model, pool, torch.device(device)

    def execute(self, out: SchedulerOutput) -> ForwardOutput:
        reqs: list[Request] = []
        hidden: list[torch.Tensor] = []
        if out.prefill:
            batch, rows = self.extend_batch(out.prefill)
            h = self.model(batch, self.pool.kv)  # (T, D)
            keep = [i for i, c in zip(rows, out.prefill) if c.samples]
            reqs += [c.request for c in out.prefill if c.samples]
            hidden.append(h[keep])
        if out.decode:
            h = self.model(self.decode_batch(out.decode), self.pool.kv)  # (B, D)
            reqs += out.decode
            hidden.append(h)
        h = torch.cat(hidden) if hidden else torch.empty(0, self.model.cfg.hidden_size, device=self.device)
        return ForwardOutput(reqs, self.model.logits(h) if len(reqs) else h.new_empty(0, 0), h)

    def extend_batch(self, chunks: list[PrefillChunk]) -> tuple[ForwardBatch, list[int]]:
        """Returns the batch and, per chunk, the row index of its last token."""
        ids, positions, slots, qo_indptr = [], [], [], [0]
        for c in chunks:
            ids += c.request.all_token_ids[c.start: c.start + c.num_tokens]
            positions.append(torch.arange(c.start, c.start + c.num_tokens))
            slots.append(self.pool.slots_for(c.request.pages, c.start, c.start + c.num_tokens))
            qo_indptr.append(qo_indptr[-1] + c.num_tokens)
        batch = ForwardBatch(
            ForwardMode.EXTEND,
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.cat(positions).to(self.device),
            out_slots=torch.cat(slots).to(self.device),
            page_size=self.pool.page_size,
            qo_indptr=qo_indptr,
            prefix_lens=[c.start for c in chunks],
            page_tables=[list(c.request.pages) for c in chunks],
        )
        return batch, [end - 1 for end in qo_indptr[1:]]

    def decode_batch(self, reqs: list[Request]) -> ForwardBatch:
        lengths = [r.num_tokens for r in reqs]  # the new token's KV is written first, then attended to
        return ForwardBatch(
            ForwardMode.DECODE,
            input_ids=torch.tensor([r.all_token_ids[-1] for r in reqs], dtype=torch.long, device=self.device),
            positions=torch.tensor([n - 1 for n in lengths], dtype=torch.long, device=self.device),
            out_slots=torch.cat([self.pool.slots_for(r.pages, n - 1, n) for r, n in zip(reqs, lengths)]).to(
                self.device),
            page_size=self.pool.page_size,
            page_table=self.pool.page_table_tensor([r.pages for r in reqs]).to(self.device),
            seq_lens=torch.tensor(lengths, dtype=torch.long, device=self.device),
        )
