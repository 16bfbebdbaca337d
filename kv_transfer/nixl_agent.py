"""One NIXL agent per KV endpoint: registered memory, peers, one-sided WRITEs with a notification, and the transport
UCX chose for them.

NIXL (NVIDIA's inference transfer library; UCX underneath: RDMA verbs, NVLink cuda_ipc, CMA, TCP) moves bytes from
memory this process registered into memory a peer registered, without the peer's CPU. Its cost is per operation, so
callers hand it a room as a few large descriptors (page runs coalesced, scattered pages staged), never one per page.
The receiver learns that a WRITE landed from the notification that follows it (NIXL delivers a transfer's
notification after its data).

The agent is not thread-safe in the sync mode without a listener thread; every call goes through one lock.

Progress. NIXL's own progress thread polls UCX without a pause (a whole core per agent, idle or not), so the agents
here run without it and progress UCX from a thread of their own, paced: every `busy_s` while the owner says
transfers are in flight (`busy()`), every `idle_s` otherwise. The target of a WRITE needs it too: over UCX's tcp
transport its data only lands as the target progresses, and a WRITE's completion waits for the target's answer on
every transport (connection set-up included).

Registration costs far more than a transfer's set-up (it pins or maps the memory for every transport UCX may use),
so a side registers its memory once: the decode pool, and an `Arena` per side for rows in transit, handed out in
blocks that go back to it when their last user drops them.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import re
import shutil
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

# The wheels' import names, newest CUDA first (nixl-cu13, nixl-cu12; `nixl` is the meta-package's).
_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
INSTALL_HINT = "pip install 'pdserve[nixl]' (NIXL's wheel for your CUDA: nixl-cu13 or nixl-cu12)"

# A descriptor: (address, bytes, device id); device id is the GPU's index for VRAM, 0 for DRAM.
Region = tuple[int, int, int]


class NixlUnavailable(ValueError):
    """NIXL is not installed (or its UCX backend did not load): the nixl transport cannot run here."""


def load_api():
    """NIXL's Python API module, or NixlUnavailable naming the extra to install."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise NixlUnavailable(f"--kv-transport nixl needs NIXL, which is not installed: {INSTALL_HINT} "
                          f"({'; '.join(errors)})")


def available() -> bool:
    try:
        load_api()
        return True
    except NixlUnavailable:
        return False


def mem_type(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


def device_id(tensor: torch.Tensor) -> int:
    return tensor.device.index if tensor.is_cuda else 0


@dataclass(frozen=True)
class Registered:
    """A registered tensor, as a peer addresses it."""

    addr: int
    nbytes: int
    device: int
    mem_type: str


_WRITE_TABLE = re.compile(r"remote memory write by ucp_put\S* from (\S+) memory to (\S+)")
_ROW = re.compile(r"\|\s*\S+\s*\|\s*[^|]*\|\s*([^|]+?)\s*\|\s*$")


_MEMORY = {"DRAM": "host", "VRAM": "cuda"}  # NIXL's memory types as UCX's tables name them


def write_transports(proto_info: str, memory: Optional[tuple[str, str]] = None) -> list[str]:
    """The UCX transports (each table row's Config column: e.g. 'cuda_ipc/cuda', 'cma/memory', 'rc_mlx5/mlx5_0:1',
    'tcp/eth0', or several lanes in one cell) in UCX_PROTO_INFO's tables for remote writes, for endpoints to peers
    (tables titled '... intra_node cfg' or 'inter_node cfg'; the agent's loopback endpoint, 'self cfg', is not a
    peer). `memory`: (source, destination) as NIXL names them ('DRAM', 'VRAM'): the tables of those writes only."""
    found: list[str] = []
    lines = proto_info.splitlines()
    for i, line in enumerate(lines):
        title = _WRITE_TABLE.search(line)
        if not title or i == 0 or " self cfg" in lines[i - 1]:
            continue
        if memory is not None and (title.group(1), title.group(2)) != tuple(_MEMORY.get(m, m) for m in memory):
            continue
        for row in lines[i + 1:]:
            if "remote memory" in row or "active message" in row or " cfg#" in row:
                break
            m = _ROW.search(row)
            if m and m.group(1) != "Config" and m.group(1) not in found:
                found.append(m.group(1))
    return found


def _ucx_log_path() -> str:
    """Where this process's UCX logs: UCX reads UCX_LOG_FILE once, when its library loads (at the process's first
    agent), so every agent of a process shares one file (the user's, or one of this process's, removed at its
    exit)."""
    if os.environ.get("UCX_LOG_FILE"):
        return os.environ["UCX_LOG_FILE"]
    folder = os.path.join(tempfile.gettempdir(), f"pdserve-nixl-{os.getpid()}")
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        atexit.register(shutil.rmtree, folder, True)
    return os.path.join(folder, "ucx.log")


class _UcxLog:
    """UCX's own log, in a file: with UCX_PROTO_INFO it prints a table of the transports it picked for each new
    endpoint configuration (at a new peer, at a first write of a kind), and its warnings. Read from where the last
    read ended; what is not a protocol table goes to this process's stderr, so no UCX warning is lost."""

    def __init__(self, path: str):
        self.path = path
        try:  # what earlier agents of this process left there is theirs
            self._offset = os.path.getsize(path)
        except OSError:
            self._offset = 0

    def read_new(self) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return ""
        data = data[:data.rfind(b"\n") + 1]  # a line UCX is still writing is read next time
        self._offset += len(data)
        text = data.decode(errors="replace")
        other = [line for line in text.splitlines() if not re.match(r"\[\d+\.\d+\] \[[^\]]+\]\s+[|+]", line)]
        if other:
            sys.stderr.write("\n".join(other) + "\n")
        return text


class NixlAgent:
    """A named NIXL agent with one backend (UCX unless told otherwise).

    UCX picks its transports from the environment it starts with (UCX_TLS, UCX_NET_DEVICES, ...): set them in the
    worker's environment to restrict it. `transport(peer)` says what it picked for writes to that peer.
    """

    def __init__(self, name: str, backend: str = "UCX", busy: Optional[Callable[[], bool]] = None,
                 busy_s: float = 0.0001, idle_s: float = 0.002):
        api = load_api()
        self.name = name
        self.backend = backend
        self._lock = threading.Lock()
        self._registrations: dict[int, Any] = {}  # address -> NIXL's registration of the tensor there
        self._peer_refs: dict[str, int] = {}  # name -> add_peer calls not yet matched by remove_peer
        self._log_lock = threading.Lock()
        self._proto = ""  # UCX's protocol tables read so far (see transport())
        self._peer_from: dict[str, int] = {}  # name -> where in them the tables printed since its add_peer start
        # UCX_PROTO_INFO is read for each context (the backend below makes one): UCX then prints its protocol
        # tables into its log, read at each new peer.
        log_path = _ucx_log_path()
        self._ucx_log = _UcxLog(log_path)
        settings = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": log_path} if backend == "UCX" else {}
        previous = {key: os.environ.get(key) for key in settings}
        os.environ.update(settings)
        try:
            self._agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[backend]))
        except Exception as e:  # noqa: BLE001 (the bindings raise their own types)
            raise NixlUnavailable(f"NIXL could not start its {backend} backend: {e}") from e
        finally:
            for key, value in previous.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if backend not in self._agent.backends:
            raise NixlUnavailable(f"NIXL has no {backend} backend here (plugins: {self._agent.get_plugin_list()})")
        self._notes: dict[str, list[bytes]] = {}  # notifications taken while progressing, until notifications()
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, args=(busy, busy_s, idle_s),
                                          name=f"nixl-progress-{name}", daemon=True)
        self._progress.start()

    def _progress_loop(self, busy: Optional[Callable[[], bool]], busy_s: float, idle_s: float) -> None:
        while not self._stop.wait(busy_s if busy is not None and busy() else idle_s):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    new = self._agent.get_new_notifs()  # progresses UCX's worker
                except Exception:  # noqa: BLE001 (a peer's failure: its WRITEs' states report it)
                    continue
                for peer, messages in new.items():
                    self._notes.setdefault(peer, []).extend(messages)

    def register(self, tensor: torch.Tensor) -> Registered:
        """Register a contiguous tensor's memory for WRITEs into it (or out of it); kept until deregister() or
        close(). The caller keeps the tensor alive as long as it is registered."""
        assert tensor.is_contiguous(), "NIXL registers contiguous memory"
        with self._lock:
            assert tensor.data_ptr() not in self._registrations, "this memory is registered already"
            self._registrations[tensor.data_ptr()] = self._agent.register_memory(tensor)
        return Registered(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device_id(tensor),
                          mem_type(tensor))

    def deregister(self, registered: Registered) -> None:
        with self._lock:
            reg = self._registrations.pop(registered.addr, None)
            if reg is not None:
                self._agent.deregister_memory(reg)

    def metadata(self) -> bytes:
        """What a peer needs to WRITE into this agent's registered memory (add_peer on its side)."""
        with self._lock:
            return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata and connect to it; its name. `transport(name)` says what UCX picked for it. A peer
        added twice (a second connection to it while the first one ends) stays until each add is removed."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._peer_refs[name] = self._peer_refs.get(name, 0) + 1
            if self._peer_refs[name] > 1:
                return name
            self._peer_from[name] = len(self._read_log())
            try:
                self._agent.make_connection(name)
            except Exception:
                self._peer_refs.pop(name)
                self._peer_from.pop(name)
                self._agent.remove_remote_agent(name)
                raise
        return name

    def transport(self, peer: str, local_mem: str = "DRAM", remote_mem: str = "DRAM") -> str:
        """UCX's transports for WRITEs from `local_mem` here to `remote_mem` at this peer, e.g. 'cuda_ipc/cuda', or
        'unknown' when UCX printed none. UCX prints a table when it makes an endpoint and when a kind of write is
        first made (for GPU memory: the first WRITE), so ask after one. The tables printed since the peer was added
        are its own; a peer whose endpoint configuration an earlier peer's shares printed none, and gets theirs."""
        text = self._read_log()
        since = text[self._peer_from.get(peer, 0):]
        picked = write_transports(since, (local_mem, remote_mem)) or write_transports(text, (local_mem, remote_mem))
        return ",".join(picked) or "unknown"

    def _read_log(self) -> str:
        with self._log_lock:
            self._proto += self._ucx_log.read_new()
            return self._proto

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            left = self._peer_refs.get(peer, 0) - 1
            if left > 0:
                self._peer_refs[peer] = left
                return
            if self._peer_refs.pop(peer, None) is not None:
                self._peer_from.pop(peer, None)
                self._agent.remove_remote_agent(peer)

    def write(self, peer: str, local: Sequence[Region], remote: Sequence[Region], local_mem: str, remote_mem: str,
              notification: bytes):
        """Start a WRITE of each local region into the remote one of the same index; the peer gets `notification`
        once the data has landed. Returns the handle to poll with state(); release() it when done."""
        assert len(local) == len(remote), "a WRITE pairs each local region with one remote region"
        with self._lock:
            src = self._agent.get_xfer_descs(list(local), local_mem)
            dst = self._agent.get_xfer_descs(list(remote), remote_mem)
            handle = self._agent.initialize_xfer("WRITE", src, dst, peer, notification)
            if self._agent.transfer(handle) == "ERR":
                self._agent.release_xfer_handle(handle)
                raise ConnectionError(f"NIXL could not start a WRITE to {peer}")
        return handle

    def state(self, handle) -> str:
        """'DONE', 'PROC' (in flight) or 'ERR' (NIXL raises for some failures, e.g. a peer that disconnected)."""
        with self._lock:
            try:
                return self._agent.check_xfer_state(handle)
            except Exception:  # noqa: BLE001 (the bindings raise their own types)
                return "ERR"

    def release(self, handle) -> None:
        with self._lock:
            with contextlib.suppress(Exception):  # a handle of a failed WRITE may refuse; it goes with the agent
                self._agent.release_xfer_handle(handle)

    def notifications(self) -> dict[str, list[bytes]]:
        """The notifications that arrived since the last call, by the sending peer's name."""
        with self._lock:
            new, self._notes = self._notes, {}
            for peer, messages in self._agent.get_new_notifs().items():
                new.setdefault(peer, []).extend(messages)
            return new

    def send_notification(self, peer: str, message: bytes) -> None:
        with self._lock:
            self._agent.send_notif(peer, message)

    def close(self) -> None:
        self._stop.set()
        self._progress.join()
        with self._lock:
            for peer in list(self._peer_refs):
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(peer)
            self._peer_from.clear()
            self._peer_refs.clear()
            for reg in self._registrations.values():
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(reg)
            self._registrations.clear()
        self._ucx_log.read_new()


class Arena:
    """One registered tensor of `nbytes` on `device`, handed out in blocks (first fit over a sorted free list): the
    memory rows wait in for their WRITE, registered once for all of them. A block goes back to the arena when the
    last reference to it is dropped (whoever drops it: a written frame, a frame dropped for a failed room, a WRITE
    that resolved), after the device work that fills it (`Block.ready`) has completed."""

    ALIGN = 256  # bytes: every block starts on a boundary any dtype and the DMA engines are happy with

    def __init__(self, agent: NixlAgent, nbytes: int, device: torch.device | str):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.registered = agent.register(self.tensor)
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted, never adjacent

    def take(self, nbytes: int) -> Optional["Block"]:
        """A block of at least `nbytes`, or None while the arena has no free range that large."""
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, free - size)
                    return Block(self, offset, size)
        return None

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def _give_back(self, offset: int, size: int, ready: list) -> None:
        if ready[0] is not None:
            ready[0].synchronize()  # the block's fill may still be queued on its stream
        with self._lock:
            free = self._free
            i = next((k for k, (o, _) in enumerate(free) if o > offset), len(free))
            assert (i == 0 or free[i - 1][0] + free[i - 1][1] <= offset) and \
                (i == len(free) or offset + size <= free[i][0]), f"block {offset}+{size} given back twice"
            if i < len(free) and offset + size == free[i][0]:  # merge with the range after it
                size += free.pop(i)[1]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # and with the one before
                offset, size = free[i - 1][0], free[i - 1][1] + size
                i -= 1
                del free[i]
            free.insert(i, (offset, size))


class Block:
    """`nbytes` of an Arena from `offset`. Set `ready` (a CUDA event) after queueing device work that fills it."""

    def __init__(self, arena: Arena, offset: int, nbytes: int):
        self.arena, self.offset, self.nbytes = arena, offset, nbytes
        self._ready: list = [None]
        weakref.finalize(self, arena._give_back, offset, nbytes, self._ready)

    @property
    def ready(self) -> Any:
        return self._ready[0]

    @ready.setter
    def ready(self, event: Any) -> None:
        self._ready[0] = event

    def view(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The block's first bytes as a contiguous tensor of `shape` and `dtype` (it must fit)."""
        count = 1
        for d in shape:
            count *= d
        assert count * dtype.itemsize <= self.nbytes, f"{tuple(shape)} {dtype} does not fit a block of {self.nbytes} B"
        return self.arena.tensor[self.offset:self.offset + count * dtype.itemsize].view(dtype).view(*shape)

    def addr(self, offset: int = 0) -> int:
        return self.arena.registered.addr + self.offset + offset

