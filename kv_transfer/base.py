"""The KV-transfer contract between a prefill worker (sender) and a decode worker (receiver).

A decode worker reserves destination pages for a request (a *room*, a uint64 chosen by the router) and calls
`KVReceiver.expect(room, ...)`; only then is the room handed to the prefill worker, which opens a
`SendHandle` with `KVSender.begin(endpoint, room, num_layers)`, streams each layer's latent KV rows as that layer's
forward finishes (`send_layer`), then the aux record (`finish`), and learns the outcome from `wait()`/`poll()`.

Every failure surfaces as a `KVTransferError` with a `kind`, on both sides, instead of a hang: an incompatible
layout is refused at the handshake, a dead peer fails its rooms promptly, and every room has a deadline.
Transports register a `Transport(sender, receiver, devices)` entry in `TRANSPORTS`: "tcp" (rows through sockets),
"nccl" and "gloo" (rows through a torch.distributed process group per prefill/decode pair, straight into the decode
pool's pages; see `collective.py`), "cuda_ipc" and "auto" (`cuda_ipc.py`). Each is the control channel every
transport shares with a data plane of its own (`plane.py`).
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from pdserve.common.registry import Registry
from pdserve.common.values import KVLayout  # noqa: F401  (part of the transfer contract)
from pdserve.kv_cache import page_runs, token_slots  # noqa: F401  (the pool's page arithmetic, for the transports)

ERROR_KINDS = frozenset({"incompatible", "unauthenticated", "unreachable", "timeout", "aborted", "peer_failed",
                         "protocol"})


class KVTransferError(Exception):
    """A transfer failed. `kind` is one of `ERROR_KINDS`:

    incompatible: prefill and decode disagree on the KV layout (refused at the handshake).
    unauthenticated: the sender's internal token is missing or wrong (refused at the handshake).
    unreachable: the decode KV endpoint cannot be connected to or does not answer the handshake.
    timeout: the room did not complete within its deadline.
    aborted: one side cancelled the room on purpose (request aborted, worker shutting down).
    peer_failed: the other side's connection dropped while the room was in progress (process killed, network).
    protocol: a malformed or unexpected frame (e.g. a room the decode worker never expected, a wrong token count,
    a payload whose checksum does not match).
    """

    def __init__(self, kind: str, message: str):
        assert kind in ERROR_KINDS, f"unknown KVTransferError kind {kind!r}"
        super().__init__(f"[{kind}] {message}")
        self.kind = kind
        self.message = message
        self.transport: str | None = None  # what the room's rows travelled over, where the side that failed it knows


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"KVLayout.dtype={name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def room_key(room: object) -> str:
    """A room's name in PDSERVE_TRACE's timeline (pdserve.common.trace): both sides mark its points under it."""
    return f"room{room}"


class TransferState(enum.IntEnum):
    BOOTSTRAPPING = 0  # sender: connecting / handshaking
    WAITING_FOR_DEST = 1  # receiver: pages reserved, nothing arrived yet
    TRANSFERRING = 2
    DONE = 3
    FAILED = 4


class TransferStatus:
    """Per-room state that only moves forward; FAILED overrides every state except DONE and is terminal.

    `advance()` and `fail()` return True when they changed the state, so exactly one caller wins a terminal
    transition (that caller delivers the completion or failure). Thread-safe.
    """

    def __init__(self, state: TransferState = TransferState.BOOTSTRAPPING):
        self._lock = threading.Lock()
        self.state = state
        self.error_kind: str | None = None
        self.error: str | None = None

    def advance(self, state: TransferState) -> bool:
        assert state != TransferState.FAILED, "use fail() to fail a transfer"
        with self._lock:
            if self.state == TransferState.FAILED or self.state == state:
                return False  # failure overrides; same state is a no-op
            # NOTE: a backwards move means two parts of the transport disagree about a room: an internal bug.
            assert state > self.state, f"transfer state cannot move back from {self.state.name} to {state.name}"
            self.state = state
            return True

    def fail(self, kind: str, message: str) -> bool:
        assert kind in ERROR_KINDS, f"unknown KVTransferError kind {kind!r}"
        with self._lock:
            if self.state in (TransferState.DONE, TransferState.FAILED):
                return False  # DONE stands; the first failure is the one reported
            self.state, self.error_kind, self.error = TransferState.FAILED, kind, message
            return True

    @property
    def finished(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    def exception(self) -> KVTransferError | None:
        if self.state != TransferState.FAILED:
            return None
        return KVTransferError(self.error_kind, self.error)

    def __repr__(self) -> str:
        err = f", {self.error_kind}: {self.error}" if self.error_kind else ""
        return f"TransferStatus({self.state.name}{err})"


def gather_rows(source: torch.Tensor, slots: torch.Tensor | None, device: torch.device | str) -> torch.Tensor:
    """A new contiguous `(num_tokens, kv_dim)` tensor on `device` holding `source[slots]` (or `source` itself
    without slots): the one copy a layer's rows take out of the pool (followed by the move to the host when rows on
    a GPU leave through the host)."""
    if slots is None:
        return source.detach().to(device, copy=True, memory_format=torch.contiguous_format)
    rows = source.detach().index_select(0, slots.to(source.device))  # (num_tokens, kv_dim): a new tensor
    return rows.to(device)  # no copy when the pool is already there


def gather_layers(source: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
    """A new contiguous `(num_layers, num_tokens, kv_dim)` tensor on the source's device: `source[:, slots]` for a
    run of the pool's layers `(num_layers, num_slots, kv_dim)` (or a copy of the rows themselves without slots),
    one gather for every layer, queued on the current stream. One layer `(num_slots, kv_dim)` gives its
    `(num_tokens, kv_dim)` rows."""
    if slots is None:
        return source.detach().to(source.device, copy=True, memory_format=torch.contiguous_format)
    return source.detach().index_select(-2, slots.to(source.device))


@dataclass(frozen=True)
class TransferStats:
    bytes_sent: int  # payload + framing bytes of this room
    # The first rows' hand-over (send_rows / send_layers) to the decode worker's confirmation: the transfer's own
    # time, not the prompt's forward a room opened at the start of it waits for (begin() when no rows came).
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_sent / self.seconds / 1e9 if self.seconds > 0 else 0.0


class SendHandle(ABC):
    """One room being sent. `send_layer`/`finish` never block on the network and never raise transfer errors
    (once the room has failed they do nothing); the outcome is read with `wait()` or `poll()`.
    Argument mistakes (wrong shape, dtype, duplicate layer) raise ValueError at once."""

    room: int
    status: TransferStatus
    # Where the transport's library picks what carries the rows, its pick (nixl: UCX's transports, e.g.
    # 'rc_mlx5/mlx5_0:1'), a label of the transfer metrics; None where the transport is all there is to say.
    link: str | None = None

    @abstractmethod
    def send_rows(self, layer: int, source: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Queue the prompt's latent rows of `layer`: `source[slots]` in token order, where `source` is the pool's
        layer `(num_slots, kv_dim)` and `slots` `(num_tokens,)` the prompt's slots (`pdserve.kv_cache.token_slots`);
        without slots, `source` is the rows themselves `(num_tokens, kv_dim)`. The transport gathers them exactly
        once, into memory it owns, before this returns: the caller may reuse or free the source pages right away."""

    def send_layer(self, layer: int, values: torch.Tensor) -> None:
        """Queue `values: (num_tokens, kv_dim)`, the rows themselves (see `send_rows`)."""
        self.send_rows(layer, values)

    # Whether a prompt's rows are best handed over layer by layer, as each layer's forward writes them (True: the
    # transfer overlaps the remaining layers, worth it where rows cross a socket or a link), or all layers at once
    # after the forward with `send_layers` (False: a device copy of microseconds, where one hand-off per layer and
    # prompt would only add host work on the prefill engine's thread).
    streams_layers: bool = True

    def send_layers(self, first_layer: int, source: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """`send_rows` for layers `first_layer .. first_layer + source.shape[0] - 1` at once: `source` is a run of
        the pool's layers `(num_layers, num_slots, kv_dim)` (or the rows themselves `(num_layers, num_tokens,
        kv_dim)` without slots). Transports that move every layer in one copy override it."""
        for i in range(source.shape[0]):
            self.send_rows(first_layer + i, source[i], slots)

    @abstractmethod
    def finish(self, aux: dict[str, Any]) -> None:
        """Queue the aux record after all layers: `first_token_id: int`, `cached_tokens: int`,
        `hidden: Tensor (hidden,) | None`, `rng_state: bytes`; other JSON-serialisable keys pass through."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> TransferStats:
        """Block until the decode worker confirmed the whole room; raise KVTransferError on failure.
        `timeout=None` waits until the sender's `timeout_s` deadline. Running out of time fails the room with
        kind "timeout" and aborts it on the decode side; use `poll()` to check without waiting."""

    @abstractmethod
    def poll(self) -> TransferState:
        """Non-blocking: the current state (applies the deadline, like `wait`)."""

    @abstractmethod
    def abort(self) -> None:
        """Prefill-side cancel: drop queued frames and tell the decode worker to release the room."""


class KVSender(ABC):
    """Prefill side. Constructed as `cls(layout, **options)`; thread-safe. Every transport takes the options
    `timeout_s`, `token` and `device` (where the rows to send live)."""

    @abstractmethod
    def begin(self, endpoint: str, room: int, num_layers: int,
              dst_pages: Sequence[int] | None = None) -> SendHandle:
        """Open `room` towards the decode endpoint (connecting and handshaking on first use, which may block for
        the connect timeout). Raises KVTransferError "unreachable" or "incompatible". `dst_pages`: the pages the
        decode worker reserved (its Reserve answer); transports that write straight into them split each layer
        by their contiguous runs and need them, TCP ignores them."""

    def begin_if_paired(self, endpoint: str, room: int, num_layers: int,
                        dst_pages: Sequence[int] | None = None) -> SendHandle | None:
        """`begin` where it cannot block: the handle when this sender already holds a live pairing with
        `endpoint`, else None (call `begin` then, off the event loop). Same errors as `begin` otherwise."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Fail every room still in flight (kind "aborted") and close all connections."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# (room, layer, dst_slots, values): values (num_tokens, kv_dim) for the caller to write at dst_slots, or None when
# the transport already wrote them there (into the receiver's kv_buffer).
OnLayer = Callable[[int, int, torch.Tensor, Optional[torch.Tensor]], None]
OnDone = Callable[[int, dict[str, Any]], None]  # (room, aux)
OnFailed = Callable[[int, KVTransferError], None]  # (room, error)


class KVReceiver(ABC):
    """Decode side. Constructed as `cls(layout, on_layer=..., on_done=..., on_failed=..., **options)`; every
    transport takes the options `host`, `port`, `timeout_s`, `token`, `max_room_tokens` and `kv_buffer` (the decode
    pool `(num_layers, num_slots, kv_dim)`: the transports write straight into its pages and call on_layer with
    `values=None`; without it, TCP hands the rows to on_layer).

    Per room the callbacks arrive in this order and never overlap: `on_layer` once per layer (layer order as
    sent; the collective transports call it once the layer's receives completed), then exactly one of `on_done` /
    `on_failed`, and nothing after that or after `cancel()` returned True. They run on the transport's threads with
    its lock held, so they must be cheap and must not block (enqueue for the engine loop); they may call the
    receiver's methods.
    """

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Where senders connect ("host:port")."""

    @abstractmethod
    def expect(self, room: int, num_tokens: int, dst_pages: Sequence[int], num_layers: int) -> None:
        """Register a room whose KV goes to `dst_pages`; must happen before the room is handed to prefill.
        The room fails with kind "timeout" unless it completes within the receiver's timeout_s."""

    @abstractmethod
    def cancel(self, room: int) -> bool:
        """Decode-side abort. True: the room was pending and is dropped, no callback follows and the caller
        frees its pages. False: the room already finished (its on_done/on_failed was delivered) or is unknown, or
        (transports writing into kv_buffer) receives are still landing in its pages: then it is dropped too and
        on_failed (kind "aborted") follows once nothing writes there any more. After False, the caller frees the
        pages when that callback arrives."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """Rooms expected and not yet finished."""

    @abstractmethod
    def close(self) -> None:
        """Fail pending rooms (kind "aborted", via on_failed) and stop all threads."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Transport(NamedTuple):
    sender: type[KVSender]
    receiver: type[KVReceiver]
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types whose KV pools it can move
    # Raises ValueError naming what to install when the transport cannot run in this process (a library it needs).
    check: Optional[Callable[[], Any]] = None


TRANSPORTS: Registry[Transport] = Registry("kv transport")


def check_transport_device(name: str, device: torch.device | str) -> None:
    """ValueError naming the fix when transport `name` cannot move KV rows that live on `device`, or cannot run here
    at all (checked when a worker is configured, before its model loads)."""
    if TRANSPORTS.get(name).check is not None:
        TRANSPORTS.get(name).check()
    kind = torch.device(device).type
    supported = TRANSPORTS.get(name).devices
    if kind in supported:
        return
    others = sorted((n for n in TRANSPORTS.names() if kind in TRANSPORTS.get(n).devices), key=lambda n: (n != "tcp", n))
    need = " or ".join("CUDA" if d == "cuda" else d.upper() for d in supported)
    raise ValueError(f"--kv-transport {name} needs a {need} device; this worker runs on {kind}: use "
                     f"{' or '.join(others)}")
