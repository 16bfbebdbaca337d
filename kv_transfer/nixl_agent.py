"""One NIXL agent per KV endpoint: registered memory, peers, one-sided WRITEs with a notification, and the transport
UCX chose for them.

NIXL (NVIDIA's inference transfer library; UCX underneath: RDMA verbs, NVLink cuda_ipc, CMA, TCP) moves bytes from
memory this process registered into memory a peer registered, without the peer's CPU. Its cost is per operation, so
callers hand it a room as a few large descriptors (page runs coalesced, scattered pages staged), never one per page.
The receiver learns that a WRITE landed from the notification that follows it (NIXL delivers a transfer's
notification after its data).

The agent is not thread-safe in the sync mode without a listener thread; every call goes through one lock.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

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


def write_transports(proto_info: str) -> list[str]:
    """The UCX transports (each table row's Config column: e.g. 'cuda_ipc/cuda', 'cma/memory', 'rc_mlx5/mlx5_0:1',
    'tcp/eth0', or several lanes in one cell) in UCX_PROTO_INFO's tables for remote writes, for endpoints to peers (tables titled '... intra_node cfg' or 'inter_node cfg';
    the agent's loopback endpoint, 'self cfg', is not a peer)."""
    found: list[str] = []
    lines = proto_info.splitlines()
    for i, line in enumerate(lines):
        if not _WRITE_TABLE.search(line) or i == 0 or " self cfg" in lines[i - 1]:
            continue
        for row in lines[i + 1:]:
            if "remote memory" in row or "active message" in row or " cfg#" in row:
                break
            m = _ROW.search(row)
            if m and m.group(1) != "Config" and m.group(1) not in found:
                found.append(m.group(1))
    return found


class _UcxLog:
    """UCX's own log, in a file: with UCX_PROTO_INFO it prints a table of the transports it picked for each new
    endpoint configuration (at a new peer, at a first write of a kind), and its warnings. Read from where the last
    read ended; what is not a protocol table goes to this process's stderr, so no UCX warning is lost."""

    def __init__(self, path: str):
        self.path = path
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

    def __init__(self, name: str, backend: str = "UCX"):
        api = load_api()
        self.name = name
        self.backend = backend
        self._lock = threading.Lock()
        self._registrations: list = []
        self._peers: dict[str, list[str]] = {}
        self._transports: list[str] = []  # UCX's picks for writes to any peer so far
        # UCX reads its configuration once, when the backend below makes its context: its protocol tables and
        # messages go to a log file of this agent's (or the one the user named), read at each new peer.
        self._tmp = tempfile.TemporaryDirectory(prefix=f"pdserve-nixl-{name}-")
        log_path = os.environ.get("UCX_LOG_FILE") or os.path.join(self._tmp.name, "ucx.log")
        self._ucx_log = _UcxLog(log_path)
        settings = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": log_path} if backend == "UCX" else {}
        previous = {key: os.environ.get(key) for key in settings}
        os.environ.update(settings)
        try:
            self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=[backend]))
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

    def register(self, tensor: torch.Tensor) -> Registered:
        """Register a contiguous tensor's memory for WRITEs into it (or out of it); kept until close()."""
        assert tensor.is_contiguous(), "NIXL registers contiguous memory"
        with self._lock:
            self._registrations.append(self._agent.register_memory(tensor))
        return Registered(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device_id(tensor),
                          mem_type(tensor))

    def metadata(self) -> bytes:
        """What a peer needs to WRITE into this agent's registered memory (add_peer on its side)."""
        with self._lock:
            return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata and connect to it; its name. `transport(name)` says what UCX picked for it."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._agent.make_connection(name)
        # A peer whose endpoint configuration is new printed its tables just now; one that shares an earlier
        # peer's configuration printed none, and gets what every peer so far got.
        picked = write_transports(self._ucx_log.read_new())
        self._transports += [t for t in picked if t not in self._transports]
        self._peers[name] = picked or list(self._transports)
        return name

    def transport(self, peer: str) -> str:
        """UCX's transports for writes to this peer, e.g. 'cuda_ipc/cuda', or 'unknown' when UCX printed none."""
        return ",".join(self._peers.get(peer) or ["unknown"])

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            if self._peers.pop(peer, None) is not None:
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
        """'DONE', 'PROC' (in flight) or 'ERR'."""
        with self._lock:
            return self._agent.check_xfer_state(handle)

    def release(self, handle) -> None:
        with self._lock:
            self._agent.release_xfer_handle(handle)

    def notifications(self) -> dict[str, list[bytes]]:
        """The notifications that arrived since the last call, by the sending peer's name."""
        with self._lock:
            return self._agent.get_new_notifs()

    def send_notification(self, peer: str, message: bytes) -> None:
        with self._lock:
            self._agent.send_notif(peer, message)

    def close(self) -> None:
        with self._lock:
            for peer in list(self._peers):
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(peer)
            self._peers.clear()
            for reg in self._registrations:
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(reg)
            self._registrations.clear()
        self._ucx_log.read_new()
        self._tmp.cleanup()

