"""The data plane of the collective KV transports: one two-rank torch.distributed process group per prefill/decode
pair (decode rank 0, prefill rank 1), the ops in flight on it, and its teardown.

The group is built directly (`ProcessGroupGloo` / `ProcessGroupNCCL` over a `PrefixStore` of the decode worker's
`TCPStore`), not through `init_process_group`: a worker pairs with any number of peers at run time, and
torch.distributed's global default group would allow one. Ops are the backend's own `send`/`recv`; the
functional API (`dist.isend`, `dist.batch_isend_irecv`) refuses groups that `new_group` did not register.

Completion: one reaper thread per pair resolves the ops in the order they were posted (Gloo: `Work.wait`; NCCL:
a CUDA event recorded on the pair's stream after the work, polled, so no engine thread ever blocks), then calls
each op's `on_complete(error)`. Ops hold their tensors until then.

Teardown (`close`): NCCL `abort()` makes the in-flight kernels exit (and stops the group's watchdog from judging
the works it ended). Gloo's `abort()` leaves pending p2p ops
waiting, but a Gloo op that times out closes its pair (locally: "Application timeout caused pair closure"; the
peer: "Connection closed by peer"), so closing posts a receive on a tag the peer never uses with a 1 ms timeout.
Either way every pending op on both sides resolves at once, the reaper drains, and the last reference to the group
is dropped. A killed peer closes its sockets by itself: Gloo fails pending ops within milliseconds.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

DECODE_RANK, PREFILL_RANK = 0, 1
DATA_TAG, POISON_TAG = 0, 1  # Gloo matches ops by (peer, tag); nothing is ever sent on POISON_TAG
# NCCL's watchdog tears the whole process down when an op outlives the group's timeout, unless the process runs
# with TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (pdserve's CLI sets that for nccl workers): our own deadlines come first.
NCCL_WATCHDOG_MARGIN_S = 120.0
ABANDON_AFTER_CLOSE_S = 10.0  # an NCCL op still running this long after abort(): give up on it (logged)
# The longest pause between two polls of an NCCL op's event: the decode worker learns that a room landed only at a
# poll, so up to this much is added to every room's latency, and on NVLink a whole room takes only milliseconds.
NCCL_POLL_MAX_S = 2e-4

OnComplete = Callable[[Optional[str]], None]  # error message, None on success


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class CollectiveBackend(ABC):
    """What differs between the Gloo (CPU tensors) and NCCL (CUDA tensors) data planes."""

    name: str
    device_type: str

    @abstractmethod
    def make_group(self, store: Any, rank: int, device: torch.device, local_host: str, connect_timeout_s: float,
                   op_timeout_s: float) -> Any:
        """A two-rank process group, connected: blocks until the peer joins."""

    @abstractmethod
    def post(self, group: Any, tensors: Sequence[torch.Tensor], send: bool, peer: int,
             then: Optional[Callable[[], None]] = None, then_stream: Any = None) -> Any:
        """Post one op per tensor, in order, counted as one batch; returns the completion token for `wait`.
        `then`: device work that reads what the batch received, run once it landed and before the batch counts as
        resolved (NCCL: queued on `then_stream` behind the ops, so the next batch's ops are not queued behind it;
        Gloo: run by `wait` after the ops)."""

    @abstractmethod
    def wait(self, token: Any, op_timeout_s: float, closed: Callable[[], bool]) -> Optional[str]:
        """Block the calling (reaper) thread until the batch resolved; its error message, None on success."""

    @abstractmethod
    def abort(self, group: Any, peer: int) -> None:
        """Make every pending op of `group`, here and on the peer, resolve now (with an error)."""

    def new_stream(self, device: torch.device) -> Any:
        return None

    def ready_event(self, device: torch.device) -> Any:
        """Recorded on the caller's current stream: ops posted `after` it see everything queued before."""
        return None

    def on_stream(self, device: torch.device, stream: Any, after: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def free_memory(self, device: torch.device) -> int:
        return 0


class GlooBackend(CollectiveBackend):
    name, device_type = "gloo", "cpu"

    def make_group(self, store, rank, device, local_host, connect_timeout_s, op_timeout_s):
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        # The address the control connection already uses: routable to the peer, unlike whatever the hostname
        # resolves to (Gloo's default).
        opts._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
        opts._threads = 2
        # NOTE: the context timeout bounds the rendezvous; ops pass their own (longer) timeout to wait().
        opts._timeout = _delta(connect_timeout_s)
        return ProcessGroupGloo(store, rank, 2, opts)

    def post(self, group, tensors, send, peer, then=None, then_stream=None):
        op = group.send if send else group.recv
        return [op([t], peer, DATA_TAG) for t in tensors], then  # Gloo does not coalesce p2p: one Work per tensor

    def wait(self, token, op_timeout_s, closed):
        works, then = token
        try:
            for work in works:
                work.wait(_delta(op_timeout_s))
            if then is not None:
                then()
        except RuntimeError as e:
            return str(e).splitlines()[0][-300:]
        return None

    def abort(self, group, peer):
        # NOTE: ProcessGroupGloo.abort() does not wake pending send/recv; a timed-out op closes the pair, which
        # fails every pending op here and, through the closed sockets, on the peer.
        try:
            group.recv([torch.empty(1, dtype=torch.uint8)], peer, POISON_TAG).wait(_delta(0.001))
        except RuntimeError:
            pass


class NcclBackend(CollectiveBackend):
    name, device_type = "nccl", "cuda"

    def make_group(self, store, rank, device, local_host, connect_timeout_s, op_timeout_s):
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL: use --kv-transport tcp")
        group = dist.ProcessGroupNCCL(store, rank, 2, _delta(op_timeout_s + NCCL_WATCHDOG_MARGIN_S))
        # NOTE: the communicator of the whole group, built now (both sides are here) rather than inside the first
        # op: coalesced p2p ops run on it. Single, uncoalesced send/recv would build a second one (ProcessGroupNCCL
        # keys those by peer pair), so every op below is coalesced, the one-run ones and the warm-up too.
        group.eager_connect_single_device(device)
        return group

    def post(self, group, tensors, send, peer, then=None, then_stream=None):
        op = group.send if send else group.recv
        group._start_coalescing()  # one ncclGroupStart/End: the runs of a layer launch as one op
        works = [op([t], peer, DATA_TAG) for t in tensors]
        works.append(group._end_coalescing())
        done = torch.cuda.Event()
        for work in works:
            if work is not None:  # ops inside a coalescing group may return no Work of their own
                work.wait()  # the current stream (the pair's) waits for NCCL's; the host does not
        if then is None:
            done.record()
            return done
        # NOTE: NCCL orders each op after the current stream (the pair's): were `then` queued there, the next
        # batch's receive would wait for this batch's scatter; on a stream of its own the two overlap.
        then_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(then_stream):
            then()
            done.record()
        return done

    def wait(self, token, op_timeout_s, closed):
        start, pause, closed_at = time.monotonic(), 5e-5, None  # polled: the reaper thread must notice close()
        while not token.query():
            now = time.monotonic()
            if closed():
                closed_at = closed_at or now
                if now - closed_at > ABANDON_AFTER_CLOSE_S:
                    logger.error("an NCCL op was still running %.0f s after abort(); abandoning it",
                                 ABANDON_AFTER_CLOSE_S)
                    return "the process group was aborted and its op did not end"
            elif now - start > op_timeout_s:
                return f"the op did not complete within {op_timeout_s:g} s"
            time.sleep(pause)
            pause = min(pause * 2, NCCL_POLL_MAX_S)
        # NOTE: abort() ends the kernels too, so an op that finished around a teardown cannot be trusted.
        return "the process group was aborted" if closed() else None

    def abort(self, group, peer):
        group.abort()

    def new_stream(self, device):
        return torch.cuda.Stream(device=device)

    def ready_event(self, device):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    @contextlib.contextmanager
    def on_stream(self, device, stream, after):
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            yield

    def free_memory(self, device):
        return torch.cuda.mem_get_info(device)[0]


BACKENDS: dict[str, CollectiveBackend] = {b.name: b for b in (GlooBackend(), NcclBackend())}


@dataclass
class _Op:
    token: Any
    tensors: Sequence[torch.Tensor]  # kept alive until the op resolved
    on_complete: Optional[OnComplete]


class ProcessGroupPair:
    """One prefill<->decode process group and the ops in flight on it. Thread-safe; `post` never blocks on the
    network. `on_broken(reason)` (set by the owner) is called once, from the reaper, when an op fails while the
    pair is open: the owner tears down its control connection and calls `close`."""

    def __init__(self, backend: CollectiveBackend, group: Any, store: Any, device: torch.device, rank: int,
                 op_timeout_s: float, name: str):
        self.backend, self.device, self.name = backend, device, name
        self.peer = PREFILL_RANK if rank == DECODE_RANK else DECODE_RANK
        self.op_timeout_s = op_timeout_s
        self.on_broken: Optional[Callable[[str], None]] = None
        self.comm_bytes = 0  # device memory the communicator took (measured around its creation)
        self._group, self._store = group, store  # the store stays alive as long as the group may use it
        self._stream = backend.new_stream(device)
        self._then_stream = backend.new_stream(device)  # what reads a batch once it landed (the decode's scatter)
        self._lock = threading.Lock()
        self._ops: queue.SimpleQueue = queue.SimpleQueue()  # _Op, then None after close()
        self.closed = False
        self._reaper = threading.Thread(target=self._reap, name=f"kv-pg-{name}", daemon=True)
        self._reaper.start()

    @classmethod
    def connect(cls, backend: CollectiveBackend, store_addr: tuple[str, int], group_id: str, rank: int,
                local_host: str, device: torch.device, connect_timeout_s: float, op_timeout_s: float,
                name: str) -> ProcessGroupPair:
        """Join the group `group_id` of the decode worker's store (both sides call this at once after HELLO_OK),
        then exchange one element so the communicator exists before the first room. Raises RuntimeError."""
        import torch.distributed as dist

        free_before = backend.free_memory(device)
        store = dist.TCPStore(store_addr[0], store_addr[1], is_master=False, timeout=_delta(connect_timeout_s),
                              wait_for_workers=False)
        group = backend.make_group(dist.PrefixStore(f"pdserve-kv/{group_id}", store), rank, device, local_host,
                                   connect_timeout_s, op_timeout_s)
        pair = cls(backend, group, store, device, rank, op_timeout_s, name)
        try:
            probe = (torch.ones if rank == PREFILL_RANK else torch.zeros)(1, dtype=torch.uint8, device=device)
            done, errors = threading.Event(), []
            pair.post([probe], send=rank == PREFILL_RANK, after=pair.ready_event(),  # after the fill, on our stream
                      on_complete=lambda e: (errors.append(e), done.set()))
            if not done.wait(connect_timeout_s) or errors[0] is not None:
                raise RuntimeError(f"the {backend.name} warm-up exchange with the peer did not complete within "
                                   f"{connect_timeout_s:g} s: {errors[0] if errors else 'no answer'}")
            if int(probe.item()) != 1:
                raise RuntimeError(f"the {backend.name} warm-up exchange carried {int(probe.item())}, not 1")
        except BaseException as e:
            pair.close(f"setting it up failed: {e}")
            raise
        pair.comm_bytes = max(0, free_before - backend.free_memory(device))
        if backend.device_type == "cuda":
            logger.info("KV process group %s ready: its NCCL communicator took %.1f MiB of %s", name,
                        pair.comm_bytes / 2**20, device)
        return pair

    def ready_event(self) -> Any:
        return self.backend.ready_event(self.device)

    def post(self, tensors: Sequence[torch.Tensor], send: bool, after: Any = None,
             on_complete: Optional[OnComplete] = None, then: Optional[Callable[[], None]] = None) -> None:
        """Post one op per tensor (to or from the peer), ordered after `after` (a `ready_event`); `then` (see
        `CollectiveBackend.post`) runs after them on the pair's stream; `on_complete` runs on the reaper thread once
        all that resolved. Raises RuntimeError once the pair is closed."""
        with self._lock:  # NOTE: ops are queued under the lock, so none can slip in behind close()'s sentinel
            if self.closed:
                raise RuntimeError(f"the KV process group {self.name} was torn down")
            with self.backend.on_stream(self.device, self._stream, after):
                token = self.backend.post(self._group, tensors, send, self.peer, then, self._then_stream)
            self._ops.put(_Op(token, tensors, on_complete))

    def close(self, reason: str) -> None:
        """Tear the group down (idempotent): pending ops resolve with errors, then the reaper drops the group."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._ops.put(None)
        logger.info("tearing down KV process group %s: %s", self.name, reason)
        try:
            self.backend.abort(self._group, self.peer)
        except Exception:  # a group that broke by itself may refuse to abort; the reaper still drains
            logger.exception("aborting KV process group %s failed", self.name)

    def _reap(self) -> None:
        while (op := self._ops.get()) is not None:
            error = self.backend.wait(op.token, self.op_timeout_s, lambda: self.closed)
            op.tensors = ()  # nothing writes into (or reads from) them any more
            if error is not None and not self.closed and self.on_broken is not None:
                self.on_broken(error)  # once: the owner's close() follows, after which errors are expected
            if op.on_complete is not None:
                try:
                    op.on_complete(error)
                except Exception:
                    logger.exception("KV process group %s: completion callback raised", self.name)
        # NOTE: every op resolved: dropping the last reference destroys the group (Gloo closes its sockets, so
        # anything the peer still waits on fails now rather than at its timeout).
        self._group = self._store = None
