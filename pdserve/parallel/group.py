"""A worker's tensor-parallel ranks as the model sees them: this rank, how many there are, and the collectives.

The process group is built directly over a TCPStore that rank 0 serves (ProcessGroupGloo on the CPU,
ProcessGroupNCCL on GPUs), not through `torch.distributed.init_process_group`: nothing global is set, and the group
reaches the layers that use it as an argument. At size 1 there is no group and every collective returns its input.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch

LOCALHOST = "127.0.0.1"  # every rank of a worker runs on one host


class TPGroup:
    """This process's place among a worker's tensor-parallel ranks. `group` is None at size 1 (and in tests that
    only load a rank's shards, which needs no collective)."""

    def __init__(self, rank: int = 0, size: int = 1, group: Optional[Any] = None):
        assert 0 <= rank < size, f"rank {rank} of {size}"
        self.rank, self.size, self._group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place (x contiguous), returned; `x` itself at size 1."""
        if self.size > 1:
            # NOTE: on NCCL wait() makes the current stream wait for the op, not the host (so CUDA graphs capture it)
            self._group.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` into every rank's `x` (in place, contiguous), returned."""
        if self.size > 1:
            self._group.broadcast(x, src).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (the same shape on each), stacked: (size, *x.shape); (1, *x.shape) at size 1."""
        if self.size == 1:
            return x[None]
        # NOTE: into one tensor (all_gather_into_tensor): NCCL writes it in place, which a CUDA graph captures (DP
        # attention's decode graphs gather every layer), where a list of outputs would be copied out afterwards.
        out = x.new_empty(self.size * x.shape[0], *x.shape[1:]) if x.dim() else x.new_empty(self.size)
        self._group._allgather_base(out, x.contiguous()).wait()
        return out.view(self.size, *x.shape)

    def close(self) -> None:
        """Release the process group (NCCL warns at exit about one never shut down); at each rank's stop, after its
        last step has finished (nothing in flight)."""
        if self._group is not None:
            self._group.shutdown()  # NCCL's waits for the graphs that captured its collectives to be destroyed
            self._group = None

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"


SINGLE = TPGroup()  # one process, no collectives: the path every model runs at --tp 1


def store_for(rank: int, size: int, port: int, timeout_s: float):
    """The rendezvous store: rank 0 serves it (port 0: a free one, read back from `.port`), the others join it."""
    import torch.distributed as dist

    return dist.TCPStore(LOCALHOST, port, size, is_master=rank == 0, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def joining_key(rank: int) -> str:
    """The store key a rank sets just before it joins the group (pdserve.parallel.ranks waits for it)."""
    return f"pdserve/joining/{rank}"


def connect(store: Any, rank: int, size: int, device: torch.device | str, timeout_s: float) -> TPGroup:
    """Join the group of `size` ranks (blocks until all have joined): NCCL on a CUDA device, Gloo on the CPU.
    A collective that waits more than timeout_s fails (a dead rank fails Gloo's at once: its sockets close)."""
    import torch.distributed as dist

    device = torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        group = dist.ProcessGroupNCCL(store, rank, size, timeout)
        # The communicator now, while every rank is here, rather than inside the first forward.
        group.eager_connect_single_device(device)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOCALHOST)]
        opts._timeout = timeout
        group = dist.ProcessGroupGloo(store, rank, size, opts)
    return TPGroup(rank, size, group)


def rank_device(device: str, rank: int) -> str:
    """The device of `rank` when rank 0 runs on `device`: cpu for every rank on the CPU; on CUDA one GPU per rank,
    counted from rank 0's (cuda and cuda:0 -> cuda:RANK, cuda:2 -> cuda:2+RANK)."""
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


__all__ = ["TPGroup", "SINGLE", "connect", "joining_key", "store_for", "rank_device"]
