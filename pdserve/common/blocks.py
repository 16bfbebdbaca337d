"""Prefix blocks named by a hash chain: block i of a sequence is its tokens `[i * page_size, (i + 1) * page_size)`;
its key hashes the key of block i-1 and its own tokens, so a key names the whole prefix up to the end of the block.
Keys are blake2b digests of little-endian int64 token ids: the same on every process and machine, so the router,
the prefill workers' caches and the shared ownership store (Redis) all name blocks alike.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterator, Sequence

HASH_BYTES = 16


def iter_block_hashes(token_ids: Sequence[int], page_size: int, num_blocks: int) -> Iterator[bytes]:
    prev = b""
    for i in range(num_blocks):
        block = token_ids[i * page_size : (i + 1) * page_size]
        h = hashlib.blake2b(prev, digest_size=HASH_BYTES)
        h.update(struct.pack(f"<{page_size}q", *(int(t) for t in block)))
        prev = h.digest()
        yield prev


def block_hashes(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Chained keys of every full block: h_i = blake2b-128(h_{i-1} + int64-LE(tokens of block i)), h_{-1} = b""."""
    if page_size <= 0:
        raise ValueError(f"page_size={page_size} must be positive")
    return list(iter_block_hashes(token_ids, page_size, len(token_ids) // page_size))
