"""Turns a SchedulerOutput into model forwards: builds the ForwardBatch tensors, runs the model over the latent
KV pool, and returns the last hidden state and logits of every row that samples."""

from __future__ import annotations

import array
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pdserve.cuda_graph import CudaGraphConfig, DecodeGraphRunner, PackedRanks, PackedRows, greedy_draft_chain
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.host_staging import HostStaging
from pdserve.kernels import KernelBackends
from pdserve.kv_cache import LatentKVPool, token_slots
from pdserve.model import DeepseekV3
from pdserve.parallel.group import TPGroup
from pdserve.request import Request
from pdserve.scheduler import PrefillChunk, SchedulerOutput


@dataclass(frozen=True)
class TokenRow:
    """One query row of a DECODE batch: `token` at `position` of `request`. The row writes its KV there and attends
    to positions 0..position, so consecutive rows of one request are causal among themselves (speculative
    verification and drafting)."""

    request: Request
    position: int
    token: int


@dataclass
class ForwardOutput:
    requests: list[Request]  # the requests that sample this step, in row order
    logits: torch.Tensor  # (rows, vocab) fp32
    hidden: torch.Tensor  # (rows, D): last hidden state before the final norm (NextN's input)
    extend_hidden: Optional[torch.Tensor] = None  # (prefill tokens, D): every prefill row's hidden state


def build_graph_runners(model: DeepseekV3, pool: LatentKVPool, kernels: KernelBackends, config: CudaGraphConfig,
                        device: str, spec_steps: int, max_model_len: int, progress: Optional[Callable[[str], None]],
                        dp: Optional[TPGroup] = None
                        ) -> tuple[Optional[DecodeGraphRunner], Optional[DecodeGraphRunner]]:
    """(target graphs, MTP-layer graphs), the latter only with speculation (spec_steps > 0 draft steps); (None,
    None) off CUDA, with graphs off, or with a backend that cannot be captured (config.eager_replay: on any device,
    with any backend). Every tensor-parallel rank captures the same graphs, in the same order (their warm-up forwards
    run the layers' collectives). dp: under DP attention the ranks' group, and the target's graphs only (the MTP
    layer's rows run eagerly)."""
    if not config.enabled or not (str(device).startswith("cuda") or config.eager_replay):
        return None, None
    unsafe = [f"{kind}={type(b).__name__}" for kind, b in
              (("attention", kernels.attention), ("moe", kernels.moe), ("gemm", kernels.gemm))
              if not getattr(b, "graph_safe", False)]
    if unsafe and not config.eager_replay:  # those synchronise with the host (data-dependent shapes): no capture
        (progress or print)(f"CUDA graphs off: backends {', '.join(unsafe)} cannot be captured "
                            "(use --attention-backend triton --moe-backend triton, or --disable-cuda-graph)")
        return None, None
    max_pages = -(-max_model_len // pool.page_size)
    if not spec_steps:
        return DecodeGraphRunner(model, pool, max_pages, config, progress, dp=dp), None
    # With NextN a batch of B requests verifies B*(k+1) rows and extends up to as many MTP rows: graphs for those
    # sizes too, so every bucket of plain decode has its speculative counterpart.
    width = spec_steps + 1
    base = config.buckets()
    config = dataclasses.replace(config, max_bs=config.max_bs * width,
                                 batch_sizes=tuple(sorted(set(base) | {b * width for b in base})))
    if dp is not None:
        return DecodeGraphRunner(model, pool, max_pages, config, progress, dp=dp), None
    return (DecodeGraphRunner(model, pool, max_pages, config, progress),
            DecodeGraphRunner(model, pool, max_pages, config, progress, mtp=True, chain_steps=spec_steps - 1,
                              chain_batch_sizes=tuple(base)))


class ModelRunner:
    """driver (pdserve.parallel.driver.Driver): rank 0 of a tensor-parallel worker calls the model through it, so
    that every call reaches the other ranks too; None in a single process."""

    def __init__(self, model: DeepseekV3, pool: LatentKVPool, device: torch.device,
                 graphs: Optional[DecodeGraphRunner] = None, mtp_graphs: Optional[DecodeGraphRunner] = None,
                 driver=None):
        self.model, self.pool, self.device = driver or model, pool, torch.device(device)
        self.driver = driver
        # DP attention: every batch says which rank each sequence's attention runs on (Driver splits it)
        self.dp = driver is not None and driver.dp_size > 1
        self.graphs = graphs  # decode batches replay captured CUDA graphs when they fit a bucket
        self.mtp_graphs = mtp_graphs  # likewise for the MTP layer's rows (NextN drafting)
        self.staging = HostStaging(self.device)  # the steps' uploads (the engine's thread only)

    def release_graphs(self) -> None:
        """Destroy the captured graphs (DecodeGraphRunner.release); batches run eagerly from then on."""
        for runner in (self.graphs, self.mtp_graphs):
            if runner is not None:
                runner.release()
        self.graphs = self.mtp_graphs = None

    def execute(self, out: SchedulerOutput, layer_done: Optional[Callable[[int], None]] = None,
                resolve_inputs: Optional[Callable[[torch.Tensor], None]] = None) -> ForwardOutput:
        """layer_done(layer) is called as each layer of the prefill forward has written its KV. resolve_inputs(ids)
        edits the decode rows' token ids on the device before they run (overlap scheduling: tokens the host has
        not read yet)."""
        reqs: list[Request] = []
        hidden: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        extend_hidden = None
        if out.prefill:
            batch, rows = self.extend_batch(out.prefill)
            batch.layer_done = layer_done
            h = extend_hidden = self.model(batch, self.pool.kv)  # (T, D)
            keep = [i for i, c in zip(rows, out.prefill) if c.samples]
            reqs += [c.request for c in out.prefill if c.samples]
            hidden.append(h[keep])
            logits.append(self.model.logits(h[keep]))
        if out.decode:
            rows = self.decode_rows(out.decode)
            replayed = self._replay(self.graphs, rows, patch=resolve_inputs)
            if replayed is not None:
                h, step_logits = replayed  # (B, D), (B, vocab)
            else:
                batch = self.rows_batch(rows)
                if resolve_inputs is not None:
                    resolve_inputs(batch.input_ids)
                h = self.model(batch, self.pool.kv)  # (B, D)
                step_logits = self.model.logits(h)
            reqs += out.decode
            hidden.append(h)
            logits.append(step_logits)
        if not reqs:
            empty = torch.empty(0, self.model.cfg.hidden_size, device=self.device)
            return ForwardOutput(reqs, empty.new_empty(0, 0), empty, extend_hidden)
        if len(logits) == 1:  # prompts only or decode rows only: nothing to join (a copy of every logit, each step)
            return ForwardOutput(reqs, logits[0], hidden[0], extend_hidden)
        return ForwardOutput(reqs, torch.cat(logits), torch.cat(hidden), extend_hidden)

    # ---- NextN/MTP layer KV ---------------------------------------------------------------------------------------
    def mtp_extend(self, chunks: list[PrefillChunk], extend_hidden: torch.Tensor) -> None:
        """Fill the MTP layer's KV at every prefill position whose next token is known: position i takes token
        i+1 and the main model's hidden state at i (all of a chunk but a sampling chunk's last position)."""
        batch_chunks, rows, offset = [], [], 0
        for c in chunks:
            n = c.num_tokens - (1 if c.samples else 0)
            if n > 0:
                batch_chunks.append(PrefillChunk(c.request, c.start, n))
                rows.append(torch.arange(offset, offset + n))
            offset += c.num_tokens
        if not batch_chunks:
            return
        batch, _ = self.extend_batch(batch_chunks, shift=1)
        self.model.mtp_forward(batch, extend_hidden[torch.cat(rows).to(extend_hidden.device)], self.pool.kv,
                               logits=False)  # only its KV is kept

    def mtp_decode(self, reqs: list[Request], next_tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """One MTP step at each request's last position with its newly sampled token; returns draft logits."""
        rows = [TokenRow(r, r.num_tokens - 1, tok) for r, tok in zip(reqs, next_tokens)]
        return self.mtp_rows(rows, hidden)[0]

    # ---- arbitrary token rows (speculative decoding) -------------------------------------------------------------
    def target_rows(self, rows: list[TokenRow], patch: Optional[Callable[[torch.Tensor], None]] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target model over token rows; returns (hidden (rows, D) before the final norm, logits fp32).
        patch(input_ids), when given, edits the rows' token ids on the device first (tokens only the device has)."""
        replayed = self._replay(self.graphs, rows, patch=patch)
        if replayed is not None:
            h, logits = replayed
            return h.clone(), logits.clone()  # the speculator keeps them across later replays
        batch = self.rows_batch(rows)
        if patch is not None:
            patch(batch.input_ids)
        h = self.model(batch, self.pool.kv)  # (rows, D)
        return h, self.model.logits(h)

    def mtp_rows(self, rows: list[TokenRow], prev_hidden: torch.Tensor,
                 patch: Optional[Callable[[torch.Tensor], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over token rows: row i takes token t_{p+1} at position p and prev_hidden[i] (h_p).
        patch(input_ids) as in target_rows. Returns (draft logits (rows, vocab) fp32, MTP hidden (rows, D))."""
        replayed = self._replay(self.mtp_graphs, rows, prev_hidden, patch)
        if replayed is not None:
            h, logits = replayed
            return logits.clone(), h.clone()  # draft states outlive the next replay
        batch = self.rows_batch(rows)
        if patch is not None:
            patch(batch.input_ids)
        return self.model.mtp_forward(batch, prev_hidden, self.pool.kv)

    def mtp_draft_chain(self, rows: list[TokenRow], prev_hidden: torch.Tensor, steps: int,
                        first: torch.Tensor) -> torch.Tensor:
        """Greedy drafts (rows, steps) on the device, chained through the MTP layer from `rows` (at position n-1)
        whose tokens are `first` (rows,) on the device, with prev_hidden (rows, D): one captured graph replay when
        one fits, else the same ops eagerly."""
        def put_first(ids: torch.Tensor) -> None:
            ids.copy_(first)

        g = self.mtp_graphs
        if g is not None and g.chain_steps == steps:
            drafts = self._replay(g, rows, prev_hidden, put_first, chain=True)
            if drafts is not None:
                return drafts.clone()  # the graph's output buffer is reused by its next replay
        batch = self.rows_batch(rows)
        put_first(batch.input_ids)
        return greedy_draft_chain(self.model, self.pool.kv, batch, prev_hidden, steps)

    def _replay(self, graphs: Optional[DecodeGraphRunner], rows: list[TokenRow],
                prev_hidden: Optional[torch.Tensor] = None, patch: Optional[Callable[[torch.Tensor], None]] = None,
                chain: bool = False):
        """DecodeGraphRunner.replay_packed for the rows when a captured graph fits them, else None (run eagerly)."""
        if graphs is None or not rows:
            return None
        width = max(len(r.request.pages) for r in rows)
        if graphs.dp is not None:
            return self._replay_ranks(graphs, rows, width, patch)
        bucket = graphs.bucket_for(len(rows), width, chain)
        if bucket is None:
            return None
        packed = self.pack_rows(rows, bucket, width)
        if self.driver is not None:  # every rank replays its graph of this bucket, on rank 0's inputs
            patch = self.driver.replay_patch(graphs, bucket, packed.width, chain, patch)
        return graphs.replay_packed(packed, prev_hidden, patch, chain)

    def _replay_ranks(self, graphs: DecodeGraphRunner, rows: list[TokenRow], width: int,
                      patch: Optional[Callable[[torch.Tensor], None]]):
        """DP attention: DecodeGraphRunner.replay_ranks when the rank with the most rows fits a bucket, else None."""
        size = graphs.dp.size
        mine: list[list[TokenRow]] = [[] for _ in range(size)]
        where = []  # each row's (rank, row there)
        for r in rows:
            k = r.request.dp_rank
            where.append((k, len(mine[k])))
            mine[k].append(r)
        bucket = graphs.bucket_for(max(map(len, mine)), width)
        if bucket is None:
            return None
        block = bucket * (4 + width)
        flat = [v for k in range(size) for v in self._flat_rows(mine[k], bucket, width)]
        flat += [k * bucket + j for k, j in where] + [k * block + j for k, j in where]  # gathered row, token id
        host = self.staging.stage(torch.frombuffer(array.array("q", flat), dtype=torch.long))
        share = None if self.driver is None else self.driver.share_blocks(bucket, width)  # (None: one rank)
        return graphs.replay_ranks(PackedRanks(host, size, bucket, width, len(rows)), patch, share)

    def pack_rows(self, rows: list[TokenRow], num_rows: int, width: int) -> PackedRows:
        """The rows in a graph's input layout, padded to num_rows, page tables `width` pages wide, on the host
        (pinned on CUDA, in the staging ring, so that the copy to the device does not wait for queued work: at small
        batch a decode step is launch-bound, and a blocking copy would stall the host until the GPU drains). Queue
        the copies out of it before the runner stages anything else."""
        flat = self._flat_rows(rows, num_rows, width)
        # NOTE: through array.array, not torch.tensor(flat): that converts int by int, on the engine's thread
        # every decode step.
        host = self.staging.stage(torch.frombuffer(array.array("q", flat), dtype=torch.long))
        return PackedRows(host, len(rows), num_rows, width)

    def _flat_rows(self, rows: list[TokenRow], num_rows: int, width: int) -> list[int]:
        """PackedRows.host's values for `rows` padded to num_rows (a dummy token writing the scratch page)."""
        ps, scratch, pad = self.pool.page_size, self.pool.scratch_page, num_rows - len(rows)
        flat = [r.token for r in rows] + [0] * pad
        flat += [r.position for r in rows] + [0] * pad
        flat += [r.request.pages[r.position // ps] * ps + r.position % ps for r in rows]  # the slot each row writes
        flat += [scratch * ps] * pad
        flat += [r.position + 1 for r in rows] + [1] * pad  # seq_lens: the row attends to positions 0..position
        for r in rows:  # short page tables padded with the scratch page (never read below seq_lens)
            flat += r.request.pages
            flat += [scratch] * (width - len(r.request.pages))
        flat += [scratch] * (width * pad)
        return flat

    def rows_batch(self, rows: list[TokenRow]) -> ForwardBatch:
        """A DECODE batch of token rows (the eager path), moved in ONE host-to-device copy, asynchronous on CUDA."""
        n = len(rows)
        packed = self.pack_rows(rows, n, max((len(r.request.pages) for r in rows), default=0))
        buf = packed.host.to(self.device, non_blocking=True)
        return ForwardBatch(ForwardMode.DECODE, input_ids=buf[:n], positions=buf[n:2 * n], out_slots=buf[2 * n:3 * n],
                            page_size=self.pool.page_size, page_table=buf[4 * n:].view(n, packed.width),
                            seq_lens=buf[3 * n:4 * n], dp_ranks=[r.request.dp_rank for r in rows] if self.dp else None)

    def extend_batch(self, chunks: list[PrefillChunk], shift: int = 0) -> tuple[ForwardBatch, list[int]]:
        """Returns the batch and, per chunk, the row index of its last token. shift=1 feeds each position the
        token after it (the MTP layer's input)."""
        ids, positions, slots, qo_indptr = [], [], [], [0]
        for c in chunks:
            ids += c.request.all_token_ids[c.start + shift: c.start + shift + c.num_tokens]
            positions.append(torch.arange(c.start, c.start + c.num_tokens))
            slots.append(token_slots(c.request.pages, c.start + c.num_tokens, self.pool.page_size, c.start))
            qo_indptr.append(qo_indptr[-1] + c.num_tokens)
        n = qo_indptr[-1]
        # ONE upload for the token ids, positions and KV slots, built on the host: no copy that waits for the GPU
        ids = torch.frombuffer(array.array("q", ids), dtype=torch.long) if ids else torch.empty(0, dtype=torch.long)
        buf = self.staging.upload(torch.cat([ids, *positions, *slots]))  # (3n,)
        batch = ForwardBatch(
            ForwardMode.EXTEND,
            input_ids=buf[:n],
            positions=buf[n:2 * n],
            out_slots=buf[2 * n:],
            page_size=self.pool.page_size,
            qo_indptr=qo_indptr,
            prefix_lens=[c.start for c in chunks],
            page_tables=[list(c.request.pages) for c in chunks],
            dp_ranks=[c.request.dp_rank for c in chunks] if self.dp else None,
        )
        return batch, [end - 1 for end in qo_indptr[1:]]

    @staticmethod
    def decode_rows(reqs: list[Request]) -> list[TokenRow]:
        """Each request's last token at its last position (its KV is written first, then attended to)."""
        return [TokenRow(r, r.num_tokens - 1, r.last_token_id) for r in reqs]
