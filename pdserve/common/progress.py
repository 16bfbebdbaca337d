"""Progress lines for operators: `[pdserve] ...` on stderr, flushed at once (model load, warm-ups, start-up)."""

from __future__ import annotations

import sys


def say(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)
