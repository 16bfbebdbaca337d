"""CUDA graphs for DECODE-mode forwards: one graph per batch-size bucket, replayed with padded batches.

Two kinds of forward are captured: the target model (plain decode, and NextN's verification rows) and the NextN/MTP
layer (NextN's draft steps and draft extend), which also reads the previous hidden state from a static buffer.
For greedy drafting the MTP runner also captures a *chain*: several draft steps in one graph, each step's argmax
feeding the next on the GPU (SGLang's multi-step draft graph), so a round pays one replay for all of its drafts
and the drafts stay on the device until the verification's acceptance reads them back.

A decode step at small batch is launch-bound (hundreds of small kernels per layer); replaying a captured graph
removes that overhead. Everything a graph reads lives in static buffers that are refilled before each replay; padded
rows decode a dummy token into the pool's scratch page, so they never touch a real request's KV.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.parallel.dp_attention import DPLayout
from pdserve.parallel.group import TPGroup

# (family: (MTP runner?, draft chain?), rows, graph) -> None; must replay the graph.
ReplayHook = Callable[[tuple, int, torch.cuda.CUDAGraph], None]


@dataclass(frozen=True)
class CudaGraphConfig:
    enabled: bool = True
    max_bs: int = 64
    batch_sizes: tuple[int, ...] = ()  # default: 1, 2, 4, 8, then every 8 up to max_bs
    # Nothing captured: each "replay" runs the bucket's forward eagerly on the same static, padded buffers. What a
    # graph runs, without CUDA: the CPU's tests of the padded-batch path (tensor-parallel replays, DP attention's
    # per-rank padding) and, on a GPU, a graph's check against the same forward.
    eager_replay: bool = False

    def buckets(self) -> list[int]:
        if self.batch_sizes:
            return sorted(b for b in set(self.batch_sizes) if 1 <= b <= self.max_bs)
        return sorted({b for b in (1, 2, 4, 8) if b <= self.max_bs} | set(range(8, self.max_bs + 1, 8)))


@dataclass(frozen=True)
class PackedRows:
    """DECODE rows in a graph's input layout, built on the host (pinned on CUDA) so that ONE host-to-device copy
    fills a graph's header and one its page table: `host` holds a header (4, rows) = token ids, positions, KV slots,
    seq_lens, then the page table (rows, width). rows is a bucket size; rows past num_rows are padding (a dummy
    token at position 0 writing and reading one slot of the scratch page)."""

    host: torch.Tensor
    num_rows: int
    rows: int
    width: int

    @property
    def header(self) -> torch.Tensor:
        return self.host[: 4 * self.rows].view(4, self.rows)

    @property
    def page_table(self) -> torch.Tensor:
        return self.host[4 * self.rows:].view(self.rows, self.width)


@dataclass(frozen=True)
class PackedRanks:
    """DP attention: a step's rows for every rank's graph of bucket `rows`, in one host tensor (pinned on CUDA):
    `size` PackedRows blocks, rank after rank (each rank's rows padded to `rows`), then for each of the step's `n`
    rows, in step order, its row in the gathered output (rank k's row j: k * rows + j) and the place of its token id
    in the blocks (k * block + j)."""

    host: torch.Tensor
    size: int
    rows: int
    width: int
    n: int

    @property
    def block(self) -> int:
        return self.rows * (4 + self.width)

    def split(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(blocks (size * block,), index (n,), ids_at (n,)) of `buf`: the host tensor or its copy on the device."""
        end = self.size * self.block
        return buf[:end], buf[end:end + self.n], buf[end + self.n:end + 2 * self.n]


class _Graph:
    def __init__(self, bs: int, max_pages: int, hidden: int, scratch_page: int, page_size: int,
                 device: torch.device, hidden_dtype: Optional[torch.dtype] = None, capture: bool = True):
        self.bs = bs
        scratch_slot = scratch_page * page_size
        # One (4, bs) buffer for the per-row inputs, so that a packed batch fills it in one copy.
        self.header = torch.ones(4, bs, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.out_slots, self.seq_lens = self.header.unbind(0)
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_slots.fill_(scratch_slot)
        self.page_table = torch.full((bs, max_pages), scratch_page, dtype=torch.long, device=device)
        self.table_width = 0  # columns of page_table that may hold real pages (the rest: the scratch page)
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        # The MTP layer's second input, h_i of the target (None for target graphs).
        self.prev_hidden = None if hidden_dtype is None else torch.zeros(bs, hidden, dtype=hidden_dtype, device=device)
        self.graph = torch.cuda.CUDAGraph() if capture else None  # None: replays run the forward eagerly
        # Host-scheduled attention (FlashInfer): each graph's plan holder, re-planned before each replay; else None.
        self.plan = self.chain_plan = None
        self.chain: Optional[torch.cuda.CUDAGraph] = None  # greedy multi-step drafting (MTP graphs only)
        self.chain_tokens: Optional[torch.Tensor] = None  # (bs, chain_steps) its output
        self.hidden: Optional[torch.Tensor] = None
        self.logits: Optional[torch.Tensor] = None

    def batch(self, page_size: int, dp: Optional[DPLayout] = None) -> ForwardBatch:
        return ForwardBatch(ForwardMode.DECODE, self.input_ids, self.positions, self.out_slots, page_size,
                            page_table=self.page_table, seq_lens=self.seq_lens, dp=dp)

    def fill_block(self, block: torch.Tensor, width: int) -> None:
        """From a packed block on the device (PackedRows.host's layout, this graph's rows): a tensor-parallel rank's
        inputs as rank 0 sent them."""
        rows = self.bs
        self.header.copy_(block[:4 * rows].view(4, rows))
        self.page_table[:, :width].copy_(block[4 * rows:].view(rows, width))
        if self.table_width > width:  # never leave another request's pages behind a row
            self.page_table[:, width:self.table_width].fill_(self.scratch_page)
        self.table_width = width

    def fill(self, batch: ForwardBatch, prev_hidden: Optional[torch.Tensor] = None) -> None:
        """From a device batch of any size up to bs (benchmarks); the serving path uses fill_packed."""
        n, width = batch.num_tokens, batch.page_table.shape[1]
        self._fill_hidden(n, prev_hidden)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.page_table[:n, :width].copy_(batch.page_table)
        self.page_table[:n, width:].fill_(self.scratch_page)
        self.table_width = width  # the columns past it were just reset
        if n < self.bs:  # padded rows: one token of attention over the scratch page
            self.input_ids[n:].zero_()
            self.positions[n:].zero_()
            self.out_slots[n:].fill_(self.scratch_slot)
            self.seq_lens[n:].fill_(1)
            self.page_table[n:].fill_(self.scratch_page)

    def fill_packed(self, packed: PackedRows, prev_hidden: Optional[torch.Tensor] = None) -> None:
        """Two copies (three with prev_hidden): each one a kernel launch the host pays at small batch."""
        assert packed.rows == self.bs, f"packed for {packed.rows} rows, graph for {self.bs}"
        self._fill_hidden(packed.num_rows, prev_hidden)
        self.header.copy_(packed.header, non_blocking=True)
        self.page_table[:, :packed.width].copy_(packed.page_table, non_blocking=True)
        if self.table_width > packed.width:  # never leave another request's pages behind a row
            self.page_table[:, packed.width:self.table_width].fill_(self.scratch_page)
        self.table_width = packed.width

    def _fill_hidden(self, n: int, prev_hidden: Optional[torch.Tensor]) -> None:
        if self.prev_hidden is not None:
            self.prev_hidden[:n].copy_(prev_hidden)
            if n < self.bs:  # zeros, not stale values: padded rows still go through routing
                self.prev_hidden[n:].zero_()


def _planning(plan, capturing: bool):
    """The attention plan's bracket around one forward (AttentionBackend.graph_plan), or nothing."""
    return plan.forward(capturing) if plan is not None else contextlib.nullcontext()


def greedy_draft_chain(model, kv: torch.Tensor, batch: ForwardBatch, prev_hidden: torch.Tensor,
                       steps: int) -> torch.Tensor:
    """`steps` greedy MTP steps from a DECODE batch (token t at position p, MTP input prev_hidden (B, D)): step
    j+1 takes step j's argmax at the next position, its KV slot looked up in the page table on the device, and
    step j's MTP hidden. No host sync, so it runs inside a CUDA graph as well as eagerly. Returns (B, steps)."""
    ps = batch.page_size
    ids, pos, seq_lens, prev = batch.input_ids, batch.positions, batch.seq_lens, prev_hidden
    tokens = []
    for _ in range(steps):
        slots = batch.page_table.gather(1, (pos // ps).unsqueeze(1)).squeeze(1) * ps + pos % ps  # (B,)
        step = ForwardBatch(ForwardMode.DECODE, ids, pos, slots, ps, page_table=batch.page_table, seq_lens=seq_lens)
        logits, prev = model.mtp_forward(step, prev, kv)
        ids = logits.argmax(dim=-1)
        tokens.append(ids)
        pos, seq_lens = pos + 1, seq_lens + 1
    return torch.stack(tokens, dim=1)


class DecodeGraphRunner:
    """Captures a DECODE forward (hidden states and logits) for each bucket; run() pads a batch to its bucket.

    mtp=False: the target model, `model(batch) -> hidden`, `model.logits(hidden)`.
    mtp=True: the NextN/MTP layer, `model.mtp_forward(batch, prev_hidden) -> (logits, hidden)`; with chain_steps > 0
    also a greedy chain of that many steps for the buckets in chain_batch_sizes (replay_packed with chain=True).
    """

    def __init__(self, model, pool, max_pages_per_seq: int, config: CudaGraphConfig,
                 progress: Optional[Callable[[str], None]] = None, mtp: bool = False, chain_steps: int = 0,
                 chain_batch_sizes: tuple[int, ...] = (), dp: Optional[TPGroup] = None):
        assert mtp or not chain_steps, "draft chains are MTP graphs"
        assert dp is None or not mtp, "under DP attention only the target model's forward is captured"
        self.model, self.pool, self.config, self.mtp = model, pool, config, mtp
        # DP attention: the ranks' group. Every rank replays its graph of one bucket, b rows of its own requests
        # padded to b (the bucket of the rank with the most), and the layers gather all ranks' b rows for the MLP:
        # a static layout, (b,) * size, where an eager DP step gathers each rank's exact count.
        self.dp = dp
        self.chain_steps, self.chain_batch_sizes = chain_steps, set(chain_batch_sizes)
        self.max_pages = max_pages_per_seq
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0  # run() calls since capture (tests and benchmarks check the graphs are used)
        # When set, every replay goes through it instead of graph.replay() (it must replay the graph): a tier's way to
        # observe its replays without this runner knowing why.
        self.replay_hook: Optional[ReplayHook] = None
        self.mempool = None if config.eager_replay else torch.cuda.graph_pool_handle()
        start = time.monotonic()
        for bs in reversed(config.buckets()):  # largest first: later graphs reuse its memory pool
            self.graphs[bs] = self._capture(bs)
        self.capture_seconds = time.monotonic() - start
        if progress:
            what = "NextN draft steps" if mtp else "decode" + (", DP attention" if dp is not None else "")
            done = "built the static buffers of" if config.eager_replay else "captured"
            progress(f"{done} {len(self.graphs)} CUDA graphs for {what} (batch sizes {config.buckets()}) "
                     f"in {self.capture_seconds:.1f}s")

    def _capture(self, bs: int) -> _Graph:
        cfg = self.model.cfg
        g = _Graph(bs, self.max_pages, cfg.hidden_size, self.pool.scratch_page, self.pool.page_size,
                   self.pool.kv.device, self.pool.dtype if self.mtp else None, capture=not self.config.eager_replay)
        batch = self._batch(g)
        attention = self.model.kernels.attention
        g.plan = attention.graph_plan(bs, self.max_pages)
        if self.config.eager_replay:  # (no draft chain: those rows run the chain's ops eagerly anyway)
            return g
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up: lazy init, autotuning, allocator, the attention plan
            for _ in range(2):
                with _planning(g.plan, capturing=False):
                    self._forward(g, batch)
        torch.cuda.current_stream().wait_stream(stream)
        # NOTE: captured on a stream of the engine's device: torch.cuda.graph's default capture stream is made once
        # per process, on whichever device was current then, so a second engine on another GPU would capture there.
        with torch.cuda.graph(g.graph, pool=self.mempool, stream=stream), _planning(g.plan, capturing=True):
            g.hidden, g.logits = self._forward(g, batch)
        if self.chain_steps and bs in self.chain_batch_sizes:
            g.chain_plan = attention.graph_plan(bs, self.max_pages)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), _planning(g.chain_plan, capturing=False):
                self._chain(g)
            torch.cuda.current_stream().wait_stream(stream)
            g.chain = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.chain, pool=self.mempool, stream=stream), _planning(g.chain_plan,
                                                                                      capturing=True):
                g.chain_tokens = self._chain(g)
        return g

    def _batch(self, g: _Graph) -> ForwardBatch:
        return g.batch(self.pool.page_size, None if self.dp is None else DPLayout(self.dp, (g.bs,) * self.dp.size))

    def _chain(self, g: _Graph) -> torch.Tensor:
        return greedy_draft_chain(self.model, self.pool.kv, g.batch(self.pool.page_size), g.prev_hidden,
                                  self.chain_steps)

    def _forward(self, g: _Graph, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mtp:
            logits, hidden = self.model.mtp_forward(batch, g.prev_hidden, self.pool.kv)
            return hidden, logits
        hidden = self.model(batch, self.pool.kv)
        return hidden, self.model.logits(hidden)

    def _replay(self, family: tuple, g: _Graph) -> None:
        graph = g.chain if family[1] else g.graph
        if graph is None:  # eager_replay: what the graph would run
            with _planning(g.plan, capturing=False):
                g.hidden, g.logits = self._forward(g, self._batch(g))
        elif self.replay_hook is not None:
            self.replay_hook(family, g.bs, graph)
        else:
            graph.replay()
        self.replays += 1

    def launch(self, g: _Graph, chain: bool = False) -> None:
        """Replay bucket `g` as its inputs stand (a tensor-parallel rank > 0, on rank 0's inputs)."""
        self._replay((self.mtp, chain), g)

    def release(self) -> None:
        """Destroy the captured graphs now (the runner has none afterwards). NOTE: NCCL frees a communicator only
        once every graph that captured one of its collectives is destroyed (its shutdown waits for that), so a
        tensor-parallel rank releases its graphs before its group; garbage collection alone may come too late."""
        if self.pool.kv.is_cuda:
            torch.cuda.synchronize(self.pool.kv.device)
        for g in self.graphs.values():
            for graph in (g.graph, g.chain):
                if graph is not None:
                    graph.reset()
        self.graphs.clear()

    def bucket_for(self, num_rows: int, width: int, chain: bool = False) -> Optional[int]:
        """The bucket that replays num_rows rows with page tables `width` pages wide (and, with chain=True, has a
        draft chain); None when no captured graph fits."""
        if num_rows > max(self.graphs, default=0) or width > self.max_pages:
            return None
        bs = min(b for b in self.graphs if b >= num_rows)
        return bs if not chain or self.graphs[bs].chain is not None else None

    def replay_packed(self, packed: PackedRows, prev_hidden: Optional[torch.Tensor] = None,
                      patch: Optional[Callable[[torch.Tensor], None]] = None, chain: bool = False):
        """Fill the bucket packed.rows from a packed batch, let patch(input_ids[:num_rows]) edit the token ids on the
        device (tokens the host has not seen), replay. Returns views of the static outputs, valid until the next
        replay of this runner: (hidden (n, D), logits (n, vocab)), or with chain=True the drafts (n, chain_steps); a
        chain's rows need pages covering positions p .. p + chain_steps - 1 (past them it writes the scratch page)."""
        assert (prev_hidden is not None) == self.mtp, "prev_hidden is the MTP graphs' input, and theirs only"
        g, n = self.graphs[packed.rows], packed.num_rows
        g.fill_packed(packed, prev_hidden)
        if patch is not None:
            patch(g.input_ids[:n])
        plan = g.chain_plan if chain else g.plan
        if plan is not None:
            plan.replan(packed.page_table, packed.header[3])
        self._replay((self.mtp, chain), g)
        return g.chain_tokens[:n] if chain else (g.hidden[:n], g.logits[:n])

    def replay_ranks(self, packed: "PackedRanks", patch: Optional[Callable[[torch.Tensor], None]] = None,
                     share: Optional[Callable[[torch.Tensor], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """DP attention, rank 0: every rank's rows of a step, packed rank after rank into the bucket packed.rows;
        patch(input_ids) edits the step's token ids (in step order) on the device, share(blocks) hands every rank's
        block to the other ranks (each then replays its own graph of the bucket), and this rank replays its own.
        Returns (hidden (n, D), logits (n, vocab)) of the step's rows in step order, gathered from all ranks."""
        g, size, rank = self.graphs[packed.rows], self.dp.size, self.dp.rank
        buf = packed.host.to(g.header.device, non_blocking=True)
        blocks, index, ids_at = packed.split(buf)
        if patch is not None:
            ids = blocks[ids_at]
            patch(ids)
            blocks[ids_at] = ids
        if share is not None:
            share(blocks)
        g.fill_block(blocks.view(size, -1)[rank], packed.width)
        if g.plan is not None:
            mine = packed.split(packed.host)[0].view(size, -1)[rank]
            g.plan.replan(mine[4 * g.bs:].view(g.bs, packed.width), mine[3 * g.bs:4 * g.bs])
        self._replay((False, False), g)
        return g.hidden[index], g.logits[index]

    def run(self, batch: ForwardBatch, prev_hidden: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden (B, D), logits (B, vocab)) for the batch's B rows: views of the graph's static outputs,
        valid until this runner's next replay. prev_hidden (B, D): the MTP layer's input (mtp runners only)."""
        assert (prev_hidden is not None) == self.mtp, "prev_hidden is the MTP graphs' input, and theirs only"
        bucket = self.bucket_for(batch.num_tokens, batch.page_table.shape[1])
        assert batch.mode is ForwardMode.DECODE and bucket is not None, "no captured graph fits this batch"
        g = self.graphs[bucket]
        g.fill(batch, prev_hidden)
        if g.plan is not None:  # benchmarks' path: reading the inputs back costs a sync
            g.plan.replan(g.page_table[:, :g.table_width].cpu(), g.seq_lens.cpu())
        self._replay((self.mtp, False), g)
        n = batch.num_tokens
        return g.hidden[:n], g.logits[:n]
