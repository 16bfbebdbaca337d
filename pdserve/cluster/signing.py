"""Signing what workers write to Redis, and verifying what a router reads there, once per content.

Anyone who can write to Redis can write a worker's registration (worker_registry.py) or a block's owner
(ownership.py). With a secret (the `--internal-token`) a worker signs what it writes: an HMAC-SHA256 keyed by the
secret over the entry, under a domain of its own per kind of entry, so a signature made for one kind is never valid
for another. A router given the same secret uses only what verifies.

A router reads the same entries again and again (every registration every second, a block's owners on every prompt
starting with it), and forged entries may be many: each entry's verdict is kept by its exact content (`Verdicts`),
so an unchanged entry is verified once.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


def mac(secret: str, domain: bytes, payload: bytes) -> str:
    """HMAC-SHA256 of payload under `domain`, keyed by secret, as lowercase hex."""
    return hmac.new(secret.encode(), domain + b"\0" + payload, hashlib.sha256).hexdigest()


def signature_matches(signature: str, secret: str, domain: bytes, payload: bytes) -> bool:
    """Whether `signature` (read from Redis: any string) is payload's mac. Never raises."""
    if not signature.isascii():  # (a hex digest is; anything else cannot even be compared as bytes)
        return False
    return hmac.compare_digest(signature.encode(), mac(secret, domain, payload).encode())


class Verdicts(Generic[V]):
    """Verdicts kept by the exact content they were reached on. Safe to share between threads (a lost race costs
    one verification more)."""

    def __init__(self) -> None:
        self._by_content: dict[Hashable, V] = {}

    def get(self, content: Hashable, verify: Callable[[], V]) -> V:
        """The verdict on `content`: verify() the first time, then the one kept."""
        try:
            return self._by_content[content]
        except KeyError:
            verdict = self._by_content[content] = verify()
            return verdict

    def bound(self, limit: int) -> None:
        """Forget every verdict once more than `limit` are kept (those of entries that are gone pile up): each
        entry still there is verified once more."""
        if len(self._by_content) > limit:
            self._by_content.clear()

    def __len__(self) -> int:
        return len(self._by_content)


__all__ = ["Verdicts", "mac", "signature_matches"]
