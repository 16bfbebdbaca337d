"""Progress lines for operators: `[pdserve] ...` on stderr, flushed at once (model load, warm-ups, start-up)."""

from __future__ import annotations

import sys


def say(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


def first_line(error: BaseException) -> str:
    """An error's message cut to its first line (its type's name when it has none): what fits in an operator's one-line
    message, the traceback being in the log."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
