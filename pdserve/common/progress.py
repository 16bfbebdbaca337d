"""Progress lines for operators: `[pdserve] ...` on stderr, flushed at once (model load, warm-ups, start-up)."""

from __future__ import annotations

import sys


def say(msg: str) -> None:
    stderr_line(f"[pdserve] {msg}")


def stderr_line(text: str) -> None:
    """`text` and its newline in one write. NOTE: stderr writes through, so print() makes the text and the newline
    two writes, and the lines of processes sharing a terminal (`pdserve up`'s workers) can run into each other."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()


def first_line(error: BaseException) -> str:
    """An error's message cut to its first line (its type's name when it has none): what fits in an operator's one-line
    message, the traceback being in the log."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
