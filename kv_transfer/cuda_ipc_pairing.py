"""What cuda_ipc and auto decide at pairing (`choose_transport`, on the facts each side sends) and the CUDA IPC
handle of the decode pool: exported, checked, mapped (`IpcBackend`, which the CPU tests replace). See `cuda_ipc.py`."""

from __future__ import annotations

import base64
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch

IPC, TCP, AUTO = "cuda_ipc", "tcp", "auto"
# What each side may pair over, by its --kv-transport.
ACCEPTS = {TCP: frozenset({TCP}), IPC: frozenset({IPC}), AUTO: frozenset({IPC, TCP})}
_MAX_HANDLE_BYTES = 4096
_COUNTER_NAME = re.compile(rb"^/torch_[A-Za-z0-9_.-]{1,200}$")  # torch's IPC reference-counter files in /dev/shm


def host_id() -> str:
    """Equal for two processes on one machine (the kernel's boot id), different across machines."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def expandable_segments_on() -> bool:
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return bool(re.search(r"expandable_segments\s*:\s*true", conf, re.IGNORECASE))


@dataclass(frozen=True)
class Facts:
    """What one side tells the other about where its KV lives."""

    host: str
    gpu: Optional[str]  # UUID of the pool's GPU; None for a CPU pool
    peers: tuple[str, ...] = ()  # UUIDs of the GPUs this side's GPU can write to (itself included)

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "gpu": self.gpu, "peers": list(self.peers)}

    @classmethod
    def from_dict(cls, d: Any) -> "Facts":
        if not isinstance(d, dict):
            raise ValueError(f"transport facts must be an object, got {type(d).__name__}")
        host, gpu, peers = d.get("host"), d.get("gpu"), d.get("peers") or []
        if not isinstance(host, str) or not (gpu is None or isinstance(gpu, str)) or not isinstance(peers, list) \
                or not all(isinstance(p, str) for p in peers):
            raise ValueError(f"malformed transport facts {str(d)[:200]}")
        return cls(host, gpu, tuple(peers[:64]))


def choose_transport(prefill_wants: str, decode_wants: str, prefill: Optional[Facts], decode: Facts,
                     export_problem: Optional[str]) -> tuple[Optional[str], str]:
    """(transport, why) for a pairing, decided by the decode receiver; transport None means refuse, and `why` says
    what to change. `export_problem`: why the decode pool cannot be exported over CUDA IPC (None: it can)."""
    allowed = ACCEPTS.get(prefill_wants, frozenset()) & ACCEPTS[decode_wants]
    if not allowed:
        return None, (f"KV transport mismatch: prefill {prefill_wants!r} vs decode {decode_wants!r} (give both "
                      "workers the same --kv-transport, or auto)")
    problem = _ipc_problem(prefill, decode, export_problem) if IPC in allowed else "not asked for"
    if IPC in allowed and problem is None:
        same = prefill.gpu == decode.gpu
        return IPC, "same GPU" if same else f"peer access from GPU {prefill.gpu} to {decode.gpu}"
    if TCP in allowed:
        return TCP, (f"cuda_ipc impossible: {problem}" if IPC in allowed else "asked for")
    return None, f"--kv-transport cuda_ipc cannot work between these workers: {problem} (use tcp or auto)"


def _ipc_problem(prefill: Optional[Facts], decode: Facts, export_problem: Optional[str]) -> Optional[str]:
    if prefill is None:
        return "the prefill worker sent no transport facts (an older pdserve)"
    if decode.gpu is None or prefill.gpu is None:
        return f"the {'decode' if decode.gpu is None else 'prefill'} worker's KV pool is not on a GPU"
    if prefill.host != decode.host:
        return "the workers are on different hosts"
    if export_problem:
        return export_problem
    if decode.gpu != prefill.gpu and decode.gpu not in prefill.peers:
        return f"the prefill GPU {prefill.gpu} has no peer access to the decode GPU {decode.gpu}"
    return None


class IpcBackend:
    """The GPU facts and calls of cuda_ipc, in one place, so the CPU tests replace them with fakes."""

    def local_facts(self, device: torch.device) -> Facts:
        device = torch.device(device)
        if device.type != "cuda":
            return Facts(host_id(), None)
        own = gpu_uuid(device)
        idx = device.index if device.index is not None else torch.cuda.current_device()
        peers = [gpu_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())
                 if i != idx and torch.cuda.can_device_access_peer(idx, i)]
        return Facts(host_id(), own, (own, *peers))

    def export_problem(self, kv: torch.Tensor) -> Optional[str]:
        """Why `kv` cannot be handed out over CUDA IPC, None when it can."""
        if kv.device.type != "cuda":
            return "the decode KV pool is not on a GPU"
        if expandable_segments_on():
            return ("the decode worker runs with expandable_segments (PYTORCH_CUDA_ALLOC_CONF), whose memory "
                    "cudaIpcGetMemHandle cannot export: unset it for cuda_ipc")
        if not kv.is_contiguous() or kv.storage_offset() != 0:
            return "the decode KV pool is not a whole contiguous allocation"
        return None

    def export(self, kv: torch.Tensor) -> dict[str, Any]:
        """The fields of `kv`'s IPC handle, JSON-serialisable (torch's own export; the receiver calls it once)."""
        (_, handle, size, offset, counter, counter_offset, event, event_sync) = kv.untyped_storage()._share_cuda_()
        return {"gpu": gpu_uuid(kv.device), "handle": _b64(handle), "storage_bytes": int(size),
                "storage_offset": int(offset), "counter": _b64(counter), "counter_offset": int(counter_offset),
                "event": _b64(event), "event_sync": bool(event_sync), "shape": list(kv.shape),
                "dtype": str(kv.dtype).removeprefix("torch.")}

    def open(self, fields: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
        """The peer's pool `(layers, slots, kv_dim)`, mapped into this process (checked by `check_export` first).
        Raises RuntimeError when the GPU or driver refuses."""
        index = _local_index(fields["gpu"])
        shape = tuple(fields["shape"])
        storage = torch.UntypedStorage._new_shared_cuda(
            index, _unb64(fields["handle"]), fields["storage_bytes"], fields["storage_offset"],
            _unb64(fields["counter"]), fields["counter_offset"], _unb64(fields["event"]), fields["event_sync"])
        stride = torch.empty(shape, device="meta").stride()
        return torch._utils._rebuild_tensor(
            torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True), 0, shape, stride)


def check_export(fields: Any, layout) -> None:
    """ValueError unless the decode worker's handle fields describe a pool of this layout that fits its storage:
    checked before anything of it reaches torch."""
    if not isinstance(fields, dict):
        raise ValueError("HELLO_OK for cuda_ipc without the pool's handle")
    shape, dtype = fields.get("shape"), fields.get("dtype")
    ints = ("storage_bytes", "storage_offset", "counter_offset")
    if not all(isinstance(fields.get(k), int) and not isinstance(fields.get(k), bool) and fields[k] >= 0
               for k in ints):
        raise ValueError(f"handle sizes must be non-negative integers: {[fields.get(k) for k in ints]}")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(d, int) and d > 0 for d in shape)):
        raise ValueError(f"pool shape {shape!r} is not (layers, slots, kv_dim)")
    if dtype != layout.dtype or shape[2] != layout.kv_dim or shape[0] < layout.num_kv_layers \
            or shape[1] < layout.page_size:
        raise ValueError(f"pool {shape} {dtype} does not hold {layout.num_kv_layers} layers of {layout.kv_dim} "
                         f"{layout.dtype} values")
    need = shape[0] * shape[1] * shape[2] * layout.torch_dtype.itemsize
    if fields["storage_bytes"] < need:
        raise ValueError(f"pool {shape} needs {need} bytes, its storage has {fields['storage_bytes']}")
    for key in ("handle", "counter", "event"):  # torch passes each as bytes, none may be missing
        value = fields.get(key)
        if not (isinstance(value, str) and 0 < len(value) <= _MAX_HANDLE_BYTES):
            raise ValueError(f"handle field {key!r} is not a short, non-empty base64 string")
    counter = _unb64(fields["counter"])
    if not _COUNTER_NAME.match(counter):
        raise ValueError(f"reference-counter name {counter[:40]!r} is not one of torch's")
    if not isinstance(fields.get("gpu"), str) or not isinstance(fields.get("event_sync"), bool):
        raise ValueError("the handle does not name its GPU or event flag")


def pool_slots(pool_shape: tuple[int, ...] | torch.Size, pages: list[int], page_size: int) -> None:
    """ValueError unless every page lies inside a pool of `pool_shape` (pages from the peer, checked before any
    write into its memory)."""
    num_pages = pool_shape[1] // page_size
    bad = [p for p in pages if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < num_pages]
    if bad:
        raise ValueError(f"destination page(s) {bad[:8]} outside the decode pool's {num_pages} pages")


def _local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", i)) == uuid:
            return i
    raise RuntimeError(f"GPU {uuid} of the decode worker is not visible to this process (CUDA_VISIBLE_DEVICES?)")


def _b64(value: bytes | str | None) -> Optional[str]:
    if isinstance(value, str):
        value = value.encode()
    return None if value is None else base64.b64encode(bytes(value)).decode()


def _unb64(value: Optional[str]) -> Optional[bytes]:
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise ValueError("a handle field is not base64") from None
