"""Ranks 1..N-1 of a tensor-parallel worker: each a process that builds the same model (its shards), KV pool and
CUDA graphs as rank 0, then loops: receive a call from rank 0 -> run that forward -> repeat (nano-vllm's
ModelRunner.loop). It schedules nothing, samples nothing and decides nothing: rank 0 does.

It ends on rank 0's stop, and by itself when rank 0 goes away: its pipe closes (idle), its Gloo collective fails
(mid-step), or, for a collective that cannot notice (NCCL), a watchdog sees that its parent process is gone.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any

import torch

from pdserve.common.progress import stderr_line
from pdserve.config import ModelConfig
from pdserve.cuda_streams import make_current
from pdserve.kernels import KernelBackends
from pdserve.kv_cache import LatentKVPool
from pdserve.model_runner import build_graph_runners
from pdserve.parallel import dp_attention
from pdserve.parallel.group import connect, joining_key, store_for
from pdserve.parallel.steps import ForwardCall, KVCall, ReplayCall, move_kv, receive_batch, receive_graph_inputs
from pdserve.weights import load_model, resolve_dtype

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class RankSetup:
    """What rank `engine.parallel.rank` builds: `engine` is rank 0's EngineConfig (pdserve.engine) with this rank's
    device and rank; max_model_len as rank 0's scheduler has it (the CUDA graphs' page-table width)."""

    engine: Any
    model_config: ModelConfig
    max_model_len: int
    store_port: int
    parent_pid: int


class RankLoop:
    def __init__(self, setup: RankSetup):
        config, cfg = setup.engine, setup.model_config
        parallel = config.parallel
        self.device = torch.device(config.device)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # the ranks share the machine's cores (oversubscribed, each would wait on the others)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.tp_size))
        make_current(self.device)
        store = store_for(parallel.rank, parallel.tp_size, setup.store_port, parallel.collective_timeout_s)
        store.set(joining_key(parallel.rank), "1")
        self.tp = connect(store, parallel.rank, parallel.tp_size, self.device, parallel.collective_timeout_s)
        self.cfg = cfg
        dtype = resolve_dtype(config.dtype, cfg)
        kernels = KernelBackends.create(config.attention_backend, config.moe_backend, config.gemm_backend)
        self.model = load_model(config.model_dir, cfg, dtype, kernels, config.load_format, config.device,
                                config.prefix_chunk_tokens, progress=lambda _msg: None, tp=self.tp,
                                ep=parallel.ep_size > 1, dp_attention=parallel.dp_attention)
        self.pool = LatentKVPool(cfg.num_kv_layers, cfg.kv_cache_dim, config.cache, dtype, config.device)
        spec = config.speculative
        self.graphs = build_graph_runners(self.model, self.pool, kernels, config.cuda_graph, config.device,
                                          spec.num_steps if spec.enabled else 0, setup.max_model_len,
                                          lambda _msg: None,  # rank 0 reports
                                          dp=self.tp if parallel.dp_attention else None)

    def run(self, conn) -> None:
        while True:
            call = conn.recv()
            if call is None:  # rank 0 stops
                return
            if isinstance(call, ReplayCall):
                self._replay(call)
            elif isinstance(call, KVCall):
                move_kv(self.tp, call, self.pool.kv)
            else:
                self._forward(call)

    def release_graphs(self) -> None:
        """Before the group closes (DecodeGraphRunner.release says why)."""
        for runner in self.graphs:
            if runner is not None:
                runner.release()

    def _forward(self, call: ForwardCall) -> None:
        batch, prev_hidden = receive_batch(self.tp, call, self.device, self.pool.page_size, self.cfg.hidden_size)
        if batch.dp_ranks is not None:  # DP attention: this rank's requests out of the whole step
            batch, prev_hidden, _ = dp_attention.split(batch, batch.dp_ranks, self.tp, prev_hidden)
        if call.mtp:
            self.model.mtp_forward(batch, prev_hidden, self.pool.kv, call.depth, logits=False)
        else:
            self.model(batch, self.pool.kv)

    def _replay(self, call: ReplayCall) -> None:
        runner = self.graphs[1] if call.mtp else self.graphs[0]
        g = runner.graphs[call.rows]
        receive_graph_inputs(self.tp, call, g)
        plan = g.chain_plan if call.chain else g.plan
        if plan is not None:  # a host-scheduled attention backend plans from host copies of the inputs
            plan.replan(g.page_table[:, :g.table_width].cpu(), g.seq_lens.cpu())
        runner.launch(g, call.chain)


def _exit_with_parent(parent_pid: int, rank: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            stderr_line(f"pdserve: tensor-parallel rank {rank}: rank 0 (pid {parent_pid}) is gone; exiting")
            os._exit(1)


def main(fd: int) -> None:
    """The process of one rank > 0 (pdserve.parallel.ranks starts it): `fd` is its end of the socket pair to rank
    0, whose first message is its RankSetup."""
    conn = connection.Connection(fd)
    setup: RankSetup = conn.recv()
    rank = setup.engine.parallel.rank
    threading.Thread(target=_exit_with_parent, args=(setup.parent_pid, rank), daemon=True,
                     name=f"tp{rank}-parent-watch").start()
    try:
        loop = RankLoop(setup)
        conn.send("ready")
        loop.run(conn)
        loop.release_graphs()
        loop.tp.close()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        stderr_line(f"pdserve: tensor-parallel rank {rank}: rank 0 (pid {setup.parent_pid}) is gone; exiting")
        sys.exit(1)
    except BaseException:
        time.sleep(PARENT_POLL_S)  # a collective that failed because rank 0 died: say that, not its traceback
        if os.getppid() != setup.parent_pid:
            stderr_line(f"pdserve: tensor-parallel rank {rank}: rank 0 (pid {setup.parent_pid}) is gone; exiting")
            sys.exit(1)
        traceback.print_exc()
        stderr_line(f"pdserve: tensor-parallel rank {rank} failed (traceback above)")
        sys.exit(1)


__all__ = ["RankSetup", "RankLoop", "main"]
