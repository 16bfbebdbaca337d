"""Prefix blocks named by a hash chain: block i of a sequence is its tokens `[i * page_size, (i + 1) * page_size)`;
its key hashes the key of block i-1 and its own tokens, so a key names the whole prefix up to the end of the block.
Keys are blake2b digests of little-endian int64 token ids: the same on every process and machine, so the router,
the prefill workers' caches and the shared ownership store (Redis) all name blocks alike.
"""

from __future__ import annotations

import array
import hashlib
import sys
from typing import Iterator, Optional, Sequence

HASH_BYTES = 16


def iter_block_hashes(token_ids: Sequence[int], page_size: int, num_blocks: int,
                      prev: bytes = b"", first_block: int = 0) -> Iterator[bytes]:
    """Keys of blocks first_block .. num_blocks-1; `prev`: the key of block first_block-1 (b"" before block 0)."""
    # NOTE: the tokens' int64-LE bytes made once, in C (array), then sliced per block: packing them block by block
    # from Python ints costs several times more, and this runs several times per prompt.
    ids = array.array("q", token_ids[first_block * page_size: num_blocks * page_size])
    if sys.byteorder != "little":
        ids.byteswap()
    data, step = memoryview(ids).cast("B"), page_size * ids.itemsize
    for i in range(num_blocks - first_block):
        h = hashlib.blake2b(prev, digest_size=HASH_BYTES)
        h.update(data[i * step:(i + 1) * step])
        prev = h.digest()
        yield prev


def block_hashes(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Chained keys of every full block: h_i = blake2b-128(h_{i-1} + int64-LE(tokens of block i)), h_{-1} = b""."""
    if page_size <= 0:
        raise ValueError(f"page_size={page_size} must be positive")
    return list(iter_block_hashes(token_ids, page_size, len(token_ids) // page_size))


def leading_block_hashes(token_ids: Sequence[int], page_size: int, num_blocks: int,
                         memo: Optional[list[bytes]] = None) -> list[bytes]:
    """The keys of the first `num_blocks` blocks. `memo`: keys of this same token sequence's leading blocks made
    before (a request's, whose tokens only grow), reused and extended in place, so a prompt is hashed once however
    often its keys are asked for (prefix match, the inserts after its prompt and at its end, ownership)."""
    if memo is None:
        return list(iter_block_hashes(token_ids, page_size, num_blocks))
    if len(memo) < num_blocks:
        memo.extend(iter_block_hashes(token_ids, page_size, num_blocks, memo[-1] if memo else b"", len(memo)))
    return memo[:num_blocks]
