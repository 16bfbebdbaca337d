"""The grant every data plane whose sender writes into the decode worker's memory itself (cuda_ipc, nixl) waits for
before it writes a row:

    BEGIN {room, num_layers, pages} ->   the decode worker checks the pages against its reservation
    <- GRANT {room, num_tokens, ...}     from now on the sender may write that many rows into those pages

The sender checks the pages against the peer's pool before BEGIN goes (`open_granted`: a page outside it would be
a write outside the pool, found nowhere later on the host), waits for GRANT before each write (`await_grant`), and a
room that failed releases a writer still waiting for it and tells the decode worker with ABORT once its writes
resolved (`fail_granted`). What else a GRANT carries (nixl: the staging offset) is the plane's.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from .base import KVTransferError, TransferState
from .cuda_ipc_pairing import pool_slots
from .wire import ABORT, BEGIN, GRANT, ProtocolError


class Grant:
    """A room's grant (`RoomHandle.plane_state` of these planes): set by the connection's reader thread at GRANT.
    Planes keep their own per-room fields on a subclass."""

    def __init__(self):
        self.granted = threading.Event()
        self.tokens: Optional[int] = None  # how many rows the decode worker reserved


def open_granted(conn: Any, handle: Any, pool_shape: tuple[int, ...], grant: Grant) -> None:
    """`SendPlane.open_room`: the room's pages checked against the decode pool `pool_shape` (KVTransferError
    "protocol" refuses the room), its grant state set, BEGIN queued."""
    try:
        pool_slots(pool_shape, handle.dst_pages, handle.layout.page_size)
    except ValueError as e:  # pages from the peer that do not fit its own pool
        raise KVTransferError("protocol", f"room {handle.room}: {e}") from None
    handle.plane_state = grant
    conn.put(handle, BEGIN, {"num_layers": handle.num_layers, "pages": handle.dst_pages})


def on_grant(header: dict[str, Any], handle: Any, prepare: Optional[Callable[[Any, Any], None]] = None,
             **fields: Callable[[Any], bool]) -> bool:
    """`SendPlane.on_reply` for GRANT (False for another reply): its token count and each of `fields` (name ->
    whether a value is valid) checked, ProtocolError otherwise; then set on the room's grant (as attributes of the
    same names), which releases its writer. `prepare(handle, grant)` runs before that (the reader thread): where the
    rows go is worked out here, while the room's prompt computes, not by its first send; a ValueError from it (a
    count the pages BEGIN named cannot hold) fails the room."""
    if header.get("kind") != GRANT:
        return False
    n, values = header.get("num_tokens"), {name: header.get(name) for name in fields}
    if not (isinstance(n, int) and not isinstance(n, bool) and n > 0) \
            or not all(valid(values[name]) for name, valid in fields.items()):
        raise ProtocolError(f"GRANT without a token count{''.join(f' and {name}' for name in fields)}: "
                            f"{str(header)[:200]}")
    if handle is not None and handle.plane_state is not None:
        grant: Grant = handle.plane_state
        grant.tokens = n
        for name, value in values.items():
            setattr(grant, name, value)
        if prepare is not None:
            try:
                prepare(handle, grant)
            except ValueError as e:
                handle._fail("protocol", f"room {handle.room}: its GRANT of {n} tokens does not fit the pages it "
                                         f"was opened with: {e}")
        grant.granted.set()
    return True


def await_grant(handle: Any, num_tokens: int) -> bool:
    """Before a write (the writer's thread, or the caller's once granted): True when the room is granted for
    `num_tokens` rows; False when it failed instead (its deadline passed, it failed meanwhile, or the decode worker
    reserved another count: the room is failed here)."""
    grant: Grant = handle.plane_state
    if not grant.granted.wait(max(0.0, handle.deadline - time.monotonic())):
        handle._expire(handle.timeout_s)
        return False
    if handle.status.state == TransferState.FAILED:
        return False
    if num_tokens != grant.tokens:
        handle._fail("protocol", f"room {handle.room}: prefill has {num_tokens} tokens, the decode worker reserved "
                                 f"{grant.tokens}")
        return False
    return True


def fail_granted(conn: Any, handle: Any) -> None:
    """`SendPlane.failed`: a writer waiting for the grant moves on (and finds the room failed); the ABORT is queued
    behind the room's writes (the writer drains them first), so the decode worker frees the pages on it."""
    if handle.plane_state is not None:
        handle.plane_state.granted.set()
    if conn.broken is None:
        conn.put(handle, ABORT, {})


__all__ = ["Grant", "await_grant", "fail_granted", "on_grant", "open_granted"]
