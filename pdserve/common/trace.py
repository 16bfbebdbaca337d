"""Per-request timestamps across the stack's processes, to see where a request's time goes between them.

Off unless PDSERVE_TRACE names a folder (`PDSERVE_TRACE=/tmp/t pdserve up ...`, inherited by every worker `up`
starts). Then each process appends `<monotonic ns> <event> <request id>` lines to `<folder>/<pid>.trace` as
requests pass the points marked with `mark` (the router's, the prefill and decode workers'; the ids are the ones
the workers see). CLOCK_MONOTONIC is one clock for every process of a host, so the files merge into one timeline:
`python benchmarks/trace_report.py FOLDER` prints the median time between consecutive points.

Off, a mark costs one global lookup. On, one line-buffered write (a few microseconds): for measuring, not for
production.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional, TextIO

FOLDER = os.environ.get("PDSERVE_TRACE") or None
_file: Optional[TextIO] = None
_lock = threading.Lock()


def mark(event: str, request_id: str) -> None:
    """Record that `request_id` passed `event` now (no-op unless PDSERVE_TRACE is set)."""
    if FOLDER is None:
        return
    line = f"{time.monotonic_ns()} {event} {request_id}\n"
    with _lock:
        _open().write(line)


def _open() -> TextIO:
    global _file
    if _file is None:
        os.makedirs(FOLDER, exist_ok=True)
        _file = open(os.path.join(FOLDER, f"{os.getpid()}.trace"), "a", buffering=1)
    return _file
