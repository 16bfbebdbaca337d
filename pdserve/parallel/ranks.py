"""Rank 0's side of a tensor-parallel worker: it starts ranks 1..N-1 (one process each, device per rank), joins
their process group, hands them every model call, watches them and stops them.

The ranks are plain subprocesses (`python -c ...worker.main`), each given one end of a socket pair for its calls,
not multiprocessing's spawn: spawn re-imports the parent's main module, so a user's script without an
`if __name__ == "__main__"` guard would start its engine again in every rank.

A rank that dies takes the worker down, and nothing waits on it forever: a watcher thread sees the process end at
once and says which rank and how; rank 0's model call in flight, or its next one, raises RankDied (a Gloo
collective fails as soon as the dead rank's sockets close; every call checks first); and a worker that has not
ended by itself EXIT_GRACE_S later (idle, or blocked in an NCCL collective that cannot notice) is ended by the
watcher with exit status 1. The ranks end when rank 0 does (pdserve.parallel.worker).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any, Callable, Optional

from pdserve.common.progress import first_line, stderr_line
from pdserve.config import ModelConfig
from pdserve.parallel.group import TPGroup, connect, joining_key, rank_device, store_for
from pdserve.parallel.worker import RankSetup

EXIT_GRACE_S = 5.0  # a dead rank: how long rank 0's own code has to raise before the watcher ends the worker
NOTICE_S = 2.0  # a failed collective: how long to wait for the watcher to name a dead rank behind it
START_TIMEOUT_S = 600.0  # the other ranks' start-up: loading their shards, capturing their graphs
STOP_TIMEOUT_S = 10.0


WORKER_MAIN = "import sys; from pdserve.parallel.worker import main; main(int(sys.argv[1]))"


def _worker_env() -> dict[str, str]:
    """This environment, with the directory pdserve is imported from first on the path (a source checkout need not
    be installed)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above pdserve/
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class RankDied(Exception):
    """A rank of this tensor-parallel worker died, so the worker cannot go on. Deliberately not a RuntimeError: not
    the user's to fix (the CLI prints its traceback and exits 1)."""


class RanksOutOfStep(RankDied):
    """A step failed on rank 0 while every rank was still running: most often a collective that waited past the
    collective timeout for a rank that hangs (or was stopped). The other ranks are then mid-step, out of step with
    rank 0, so the worker cannot go on either."""


@dataclass
class _Rank:
    rank: int
    device: str
    process: Any
    conn: Any


def _how_it_ended(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode} (its error is above)"


class Ranks:
    """Rank 0 of `engine.parallel.tp_size` ranks; `group` is its TPGroup (the model's). `engine`: rank 0's
    EngineConfig (pdserve.engine); `device`: rank 0's device, the others counted from it (group.rank_device)."""

    def __init__(self, engine: Any, model_config: ModelConfig, device: str, max_model_len: int,
                 progress: Callable[[str], None]):
        parallel = engine.parallel
        self.size, self.progress = parallel.tp_size, progress
        self.timeout_s = parallel.collective_timeout_s
        self.failure: Optional[str] = None
        self._failed, self._closing = threading.Event(), threading.Event()
        self._out_of_step: Optional[str] = None  # why, once a step failed with every rank running
        self._lock = threading.Lock()
        self._ranks: list[_Rank] = []
        # What must go before rank 0's group can: its CUDA graphs (see `first_release`)
        self._releases: list[Callable[[], None]] = []
        store = store_for(0, self.size, 0, START_TIMEOUT_S)
        atexit.register(self.close)
        try:
            self._start(engine, model_config, device, max_model_len, store)
        except BaseException:
            self.close()
            raise
        self._store = store

    def _start(self, engine: Any, model_config: ModelConfig, device: str, max_model_len: int, store: Any) -> None:
        parallel = engine.parallel
        for rank in range(1, self.size):
            rank_engine = dataclasses.replace(engine, device=rank_device(device, rank),
                                              parallel=dataclasses.replace(parallel, rank=rank))
            ours, theirs = connection.Pipe()
            process = subprocess.Popen([sys.executable, "-c", WORKER_MAIN, str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], env=_worker_env())
            theirs.close()
            r = _Rank(rank, rank_engine.device, process, ours)
            self._ranks.append(r)
            ours.send_bytes(pickle.dumps(RankSetup(rank_engine, model_config, max_model_len, store.port,
                                                   os.getpid())))
            threading.Thread(target=self._watch, args=(r,), name=f"tp-rank{rank}-watcher", daemon=True).start()
            self.progress(f"tensor-parallel rank {rank} of {self.size} started (pid {process.pid}, "
                          f"{rank_engine.device})")
        # NOTE: the group's rendezvous waits only the collective timeout (which may be a second or two), while a rank
        # can take longer than that to import torch on a busy host: so first each rank says, through the store,
        # that it is about to join (pdserve.parallel.worker), which may take the start-up timeout.
        joining = [joining_key(r.rank) for r in self._ranks]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check(joining):
            self.check()
            if time.monotonic() > deadline:
                raise RankDied(f"the tensor-parallel ranks did not start within {START_TIMEOUT_S:g}s")
            time.sleep(0.02)
        with self.guard():
            self.group: TPGroup = connect(store, 0, self.size, device, parallel.collective_timeout_s)

    # ---- failures ----------------------------------------------------------------------------------------------
    def _watch(self, r: _Rank) -> None:
        code = r.process.wait()
        with self._lock:
            if self._closing.is_set() or self._failed.is_set():
                return
            self.failure = (f"tensor-parallel rank {r.rank} of {self.size} (pid {r.process.pid}, {r.device}) "
                            f"{_how_it_ended(code)}: this worker cannot run without it and stops")
            self._failed.set()
        stderr_line(f"pdserve: {self.failure}")
        if self._closing.wait(EXIT_GRACE_S):
            return
        stderr_line("pdserve: ending this worker (it did not stop by itself)")
        os._exit(1)

    def check(self) -> None:
        """RankDied when a rank has died, RanksOutOfStep once a step failed with every rank running."""
        if self._failed.is_set():
            raise RankDied(self.failure)
        if self._out_of_step is not None:
            raise RanksOutOfStep(self._out_of_step)

    @contextlib.contextmanager
    def guard(self):
        """Around rank 0's part of a call every rank makes: RankDied, naming the rank, when one has died; else
        RanksOutOfStep (the failed collective, e.g. a timeout, chained): either way the worker cannot go on."""
        self.check()
        try:
            yield
        except (RuntimeError, OSError, EOFError) as e:
            if self._failed.wait(NOTICE_S):
                raise RankDied(self.failure) from e
            self._out_of_step = (f"a step of the {self.size} tensor-parallel ranks failed on rank 0 with every rank "
                                 f"still running: {first_line(e)}. A "
                                 f"collective fails so when a rank does not join it within the collective timeout "
                                 f"({self.timeout_s:g}s, --collective-timeout): a rank hangs. The ranks are out of "
                                 "step, so this worker stops")
            raise RanksOutOfStep(self._out_of_step) from e

    # ---- calls -------------------------------------------------------------------------------------------------
    def announce(self, call: Any) -> None:
        """Hand `call` (pdserve.parallel.steps) to every other rank; its tensors follow through `group`."""
        data = pickle.dumps(call)
        for r in self._ranks:
            r.conn.send_bytes(data)

    def wait_ready(self) -> None:
        """Block until every other rank has built its model, pool and graphs (RankDied if one died meanwhile)."""
        for r in self._ranks:
            while not r.conn.poll(0.1):
                self.check()
            with self.guard():
                message = r.conn.recv()
            assert message == "ready", message
        self.progress(f"tensor-parallel ranks ready: {self.size} ({', '.join(r.device for r in self._ranks)} "
                      "beside rank 0)")

    def first_release(self, release: Callable[[], None]) -> None:
        """Have close() call `release` before it closes the group, at exit too: rank 0's CUDA graphs
        (pdserve.cuda_graph.DecodeGraphRunner.release says why they must go first)."""
        self._releases.append(release)

    def close(self) -> None:
        """Stop the other ranks (idempotent; also at exit)."""
        if self._closing.is_set():
            return
        with self._lock:
            self._closing.set()
        atexit.unregister(self.close)
        healthy = not self._failed.is_set() and self._out_of_step is None
        # (Not after a failure: a graph's release waits for the device, where a collective may wait for a dead rank.)
        for release in self._releases if healthy else ():
            try:
                release()
            except RuntimeError as e:  # a broken device: the group's close below is all that is left to try
                stderr_line(f"pdserve: stopping the tensor-parallel ranks: releasing rank 0's CUDA graphs failed: {e}")
        for r in self._ranks:
            if not healthy:
                r.process.kill()  # mid-step, hung or gone: no stop message would be read
            with contextlib.suppress(OSError, ValueError):
                r.conn.send(None)
        group = getattr(self, "group", None)
        if group is not None and healthy:
            # NOTE: rank 0 closes its group now, beside the ranks closing theirs as they stop, so that nothing of the
            # group waits on a peer already gone.
            group.close()
        for r in self._ranks:
            try:
                r.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                r.process.kill()
                r.process.wait(STOP_TIMEOUT_S)
            r.conn.close()
        if group is not None:
            group.close()  # (a failed group: after its ranks are gone; idempotent)
        self._store = None

    @property
    def pids(self) -> list[int]:
        """The other ranks' process ids, rank 1 first."""
        return [r.process.pid for r in self._ranks]


__all__ = ["Ranks", "RankDied", "RanksOutOfStep"]
