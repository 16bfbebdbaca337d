"""Where `pdserve up` puts its workers: which GPU each prefill and decode worker runs on, and how KV moves between
each pair. Pure arithmetic on the flags and the GPU count, so it is tested without a GPU.

    --gpus 0,1                       the GPUs the stack may use; the prefill workers take the first half of the list
                                     (rounded up), the decode workers the rest; one GPU: both tiers share it
    --prefill-gpus 0 --decode-gpus 1 each tier's GPUs, explicitly (one of them alone: the other tier takes the rest
                                     of --gpus)

Workers of a tier go round robin over its GPUs. Without any of these flags every worker runs on --device (one GPU,
or the CPU), except with --kv-transport nccl, which needs a GPU per worker: worker k then runs on cuda:k.

With --tp N a worker's ranks run on N GPUs in a row, counted up from its own (pdserve/parallel/group.rank_device):
a tier's GPUs are taken N at a time, each run of N consecutive. Where --gpus splits into halves too small for N,
both tiers span the whole list (each GPU then holds a prefill and a decode rank: --gpus 0,1 --tp 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from pdserve.cli.engine_args import UsageError


def gpu_list(text: str) -> tuple[int, ...]:
    """argparse type of the GPU-list flags: "0,1" -> (0, 1)."""
    import argparse

    try:
        gpus = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU indices, e.g. 0,1") from None
    if any(g < 0 for g in gpus):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices are 0 or more")
    if len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"{text!r} names a GPU twice")
    return gpus


@dataclass(frozen=True)
class Placement:
    """The device of each worker (its rank 0's), prefill workers first, in the order `up` starts them; `tp`: the GPUs
    each worker spans, counted up from its device."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    tp: int = 1

    @property
    def devices(self) -> tuple[str, ...]:
        return self.prefill + self.decode

    def span(self, device: str) -> tuple[str, ...]:
        """The devices of a worker on `device`: its ranks'."""
        first = _device_gpu(device)
        return (device,) if first is None or self.tp == 1 else tuple(f"cuda:{first + r}" for r in range(self.tp))

    @property
    def shares_gpu(self) -> bool:
        """Whether a decode worker shares a GPU with a prefill worker (then decode steps are paced)."""
        spans = [set(self.span(d)) for d in self.prefill]
        return any(d.startswith("cuda") and any(set(self.span(d)) & s for s in spans) for d in self.decode)

    def where(self, device: str) -> str:
        """A worker's place as `up` logs it: cuda:0, or cuda:0-1 (TP2)."""
        span = self.span(device)
        return device if len(span) == 1 else f"{span[0]}-{span[-1].split(':')[1]} (TP{self.tp})"

    def pair_transport(self, kv_transport: str, prefill: str, decode: str) -> str:
        """What `kv_transport` moves KV over between a prefill worker on `prefill` and a decode worker on `decode`
        (auto: cuda_ipc between GPUs of this host, over NVLink or PCIe peer copies; tcp on the CPU)."""
        if kv_transport != "auto":
            return kv_transport
        return "cuda_ipc" if prefill.startswith("cuda") and decode.startswith("cuda") else "tcp"

    def describe(self, kv_transport: str) -> list[str]:
        """The lines `up` logs at start: each worker's device, and each distinct pair of devices' transport."""
        lines = [", ".join(f"{role} worker {i} on {self.where(dev)}" for role, devs in (("prefill", self.prefill),
                                                                           ("decode", self.decode))
                           for i, dev in enumerate(devs))]
        for p in dict.fromkeys(self.prefill):
            for d in dict.fromkeys(self.decode):
                how = self.pair_transport(kv_transport, p, d)
                where = "on the same GPU" if p == d and p.startswith("cuda") else (
                    "across GPUs" if p.startswith("cuda") and d.startswith("cuda") else "")
                lines.append(f"KV {p} -> {d}: {how}{' ' + where if where else ''}"
                             + (" (auto)" if kv_transport == "auto" else ""))
        return lines


def _device_gpu(device: str) -> Optional[int]:
    """The GPU index --device names ("cuda" is GPU 0), None off CUDA."""
    if not device.startswith("cuda"):
        return None
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _worker_gpus(role: str, tier: Sequence[int], tp: int) -> tuple[int, ...]:
    """The first GPU of each place a worker of this tier can take: the tier's GPUs N (= tp) at a time, each run of
    N consecutive GPUs, as a worker's ranks count up from its first."""
    if tp == 1:
        return tuple(tier)
    names = ",".join(map(str, tier))
    if len(tier) < tp:
        raise UsageError(f"--tp {tp} runs a {role} worker on {tp} GPUs; its tier has {len(tier)} ({names}): give it "
                         f"{tp} (--{role}-gpus), or list {tp} in --gpus for both tiers to span")
    runs = [tuple(tier[i:i + tp]) for i in range(0, len(tier) - tp + 1, tp)]
    for run in runs:
        if run != tuple(range(run[0], run[0] + tp)):
            raise UsageError(f"--tp {tp}: a {role} worker's ranks run on consecutive GPUs from its first, and "
                             f"{','.join(map(str, run))} of {names} are not: list its tier's GPUs in runs of {tp}")
    return tuple(run[0] for run in runs)


def place_workers(device: str, num_prefill: int, num_decode: int, kv_transport: str, gpu_count: int,
                  gpus: Optional[Sequence[int]] = None, prefill_gpus: Optional[Sequence[int]] = None,
                  decode_gpus: Optional[Sequence[int]] = None, tp: int = 1) -> Placement:
    """Each worker's device (a tensor-parallel worker's rank 0), or a UsageError naming the flag to fix.
    `gpu_count`: the GPUs this machine has; `tp`: GPUs per worker."""
    explicit = gpus is not None or prefill_gpus is not None or decode_gpus is not None
    if _device_gpu(device) is None:
        if explicit:
            raise UsageError(f"--gpus, --prefill-gpus and --decode-gpus place workers on GPUs; --device is {device}")
        if kv_transport == "nccl":
            raise UsageError("--kv-transport nccl moves KV between GPUs; --device is " + device + " (use tcp)")
        return Placement((device,) * num_prefill, (device,) * num_decode)
    if not explicit:
        if kv_transport != "nccl":
            first = _device_gpu(device)
            if tp > 1 and first + tp > gpu_count:
                raise UsageError(f"--tp {tp} runs each worker on {tp} GPUs from {device}'s: GPUs {first}-"
                                 f"{first + tp - 1}, and this machine has {gpu_count}")
            return Placement((device,) * num_prefill, (device,) * num_decode, tp)
        if tp > 1:
            raise UsageError(f"--kv-transport nccl puts each worker on its own GPU, --tp {tp} on {tp}: give each "
                             "tier its GPUs (--prefill-gpus, --decode-gpus)")
        need = num_prefill + num_decode  # NCCL refuses two ranks on one GPU: a GPU per worker
        if gpu_count < need:
            raise UsageError(f"--kv-transport nccl puts each worker on its own GPU: {need} workers need {need} GPUs, "
                             f"this machine has {gpu_count} (use auto, or fewer workers)")
        gpus = tuple(range(need))
        prefill_gpus, decode_gpus = gpus[:num_prefill], gpus[num_prefill:]
    pool = tuple(gpus) if gpus is not None else tuple(dict.fromkeys((*(prefill_gpus or ()), *(decode_gpus or ()))))
    for flag, chosen in (("--gpus", gpus), ("--prefill-gpus", prefill_gpus), ("--decode-gpus", decode_gpus)):
        if chosen is None:
            continue
        if not chosen:
            raise UsageError(f"{flag} names no GPU")
        for g in chosen:
            if g >= gpu_count:
                raise UsageError(f"{flag}: GPU {g} does not exist (this machine has {gpu_count}: 0-"
                                 f"{gpu_count - 1})" if gpu_count else f"{flag}: this machine has no GPU")
        if gpus is not None and flag != "--gpus" and set(chosen) - set(gpus):
            raise UsageError(f"{flag} names GPUs outside --gpus {','.join(map(str, gpus))}")
    if prefill_gpus is None and decode_gpus is None:
        half = -(-len(pool) // 2)
        if len(pool) == 1 or len(pool) - half < tp <= len(pool):
            prefill_gpus = decode_gpus = pool
        else:
            prefill_gpus, decode_gpus = pool[:half], pool[half:]
    elif prefill_gpus is None or decode_gpus is None:
        rest = tuple(g for g in pool if g not in (prefill_gpus or decode_gpus))
        if not rest:
            given = "--prefill-gpus" if decode_gpus is None else "--decode-gpus"
            other = "--decode-gpus" if decode_gpus is None else "--prefill-gpus"
            raise UsageError(f"{given} takes every GPU of --gpus: give {other} too (a GPU may serve both tiers)")
        prefill_gpus, decode_gpus = (prefill_gpus, rest) if decode_gpus is None else (rest, decode_gpus)
    firsts = {role: _worker_gpus(role, tier, tp) for role, tier in (("prefill", prefill_gpus), ("decode", decode_gpus))}
    placement = Placement(tuple(f"cuda:{firsts['prefill'][i % len(firsts['prefill'])]}" for i in range(num_prefill)),
                          tuple(f"cuda:{firsts['decode'][i % len(firsts['decode'])]}" for i in range(num_decode)), tp)
    if kv_transport == "nccl":
        shared = sorted({g for d in placement.prefill for g in placement.span(d)}
                        & {g for d in placement.decode for g in placement.span(d)})
        if shared:
            raise UsageError(f"--kv-transport nccl cannot pair a prefill and a decode worker on one GPU ({shared[0]}; "
                             "NCCL refuses two ranks on a device): give the tiers different GPUs, or use auto")
    return placement
