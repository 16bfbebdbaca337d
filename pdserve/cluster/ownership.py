"""Which prefill worker holds which prefix blocks, so the router can send a prompt where its prefix is cached.

Blocks are the chained hashes of `pdserve.prefix_cache.block_hashes`: block i's hash names the whole prefix up to the
end of block i, so a worker is worth as many blocks as it owns contiguously from block 0 (a later block without its
predecessors cannot be reused). Ownership is advisory: a stale entry costs one prefix miss, never a wrong answer.

Two stores, chosen by name from `OWNERSHIP_STORES`:
  "memory"  in-process, for a single router that learns ownership from the responses it forwards (the default);
  "redis"   shared by several routers, written by the prefill workers themselves (or by the routers).

What is read from Redis is untrusted input (anyone who can write to Redis can write a block's owner): an entry no
worker wrote is skipped, never an error for the prompt it sits on; with a secret, entries are signed and only those
that verify are used (RedisOwnership).
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from typing import Callable, Iterable, Optional, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.common.registry import Registry

from .signing import Verdicts, mac, signature_matches


class OwnershipUnavailable(RuntimeError):
    """The shared store cannot be reached (or answered nonsense); the router should route by load alone."""


class OwnershipStore(ABC):
    """Which worker owns which prefix blocks. All methods are thread-safe."""

    # True where a call waits on the network (a router calls those off its event loop; the others inline: a
    # thread hop costs more than the call).
    blocking: bool = True

    @abstractmethod
    def record(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        """`worker_id` now holds these blocks in its prefix cache."""

    @abstractmethod
    def remove(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        """`worker_id` evicted these blocks."""

    @abstractmethod
    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """worker id -> number of leading blocks of `hashes` (the chain of one prompt) it owns from block 0 on.

        Workers owning no leading block are absent, so unknown hashes give {}."""

    @abstractmethod
    def drop_worker(self, worker_id: str) -> None:
        """Forget everything `worker_id` owned (it died, or restarted with an empty cache)."""

    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""


def leading_runs(owner_sets: Iterable[set[str]]) -> dict[str, int]:
    """Given the owners of block 0, 1, ... in order, how many leading blocks each worker owns without a gap."""
    runs: dict[str, int] = {}
    alive: set[str] | None = None
    for i, owners in enumerate(owner_sets):
        alive = set(owners) if alive is None else alive & owners
        if not alive:
            break
        for worker in alive:
            runs[worker] = i + 1
    return runs


OWNERSHIP_STORES: Registry[type[OwnershipStore]] = Registry("ownership store")


@OWNERSHIP_STORES.register("memory")
class MemoryOwnership(OwnershipStore):
    """In-process dicts behind one lock: exact, no expiry (drop_worker forgets a dead worker)."""

    blocking = False

    def __init__(self) -> None:
        self._owners: dict[bytes, set[str]] = {}  # block hash -> workers holding it
        self._held: dict[str, set[bytes]] = {}  # worker -> block hashes it holds (for drop_worker)
        self._lock = threading.Lock()

    def record(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        with self._lock:
            held = self._held.setdefault(worker_id, set())
            for h in hashes:
                self._owners.setdefault(bytes(h), set()).add(worker_id)
                held.add(bytes(h))

    def remove(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        with self._lock:
            held = self._held.get(worker_id, set())
            for h in hashes:
                self._discard(bytes(h), worker_id)
                held.discard(bytes(h))

    def _discard(self, h: bytes, worker_id: str) -> None:
        owners = self._owners.get(h)
        if owners is not None:
            owners.discard(worker_id)
            if not owners:
                del self._owners[h]

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        empty: set[str] = set()
        with self._lock:
            return leading_runs(self._owners.get(bytes(h), empty) for h in hashes)

    def drop_worker(self, worker_id: str) -> None:
        with self._lock:
            for h in self._held.pop(worker_id, set()):
                self._discard(h, worker_id)


def redis_client(url: str, socket_timeout: float = 0.5) -> redis.Redis:
    """A client that fails fast: short timeouts and no retries. NOTE: retries are pinned because redis-py's default
    depends on how the client is built (`Redis(host=...)` retries 10 times with backoff, seconds per call while
    Redis is away). A broken connection is dropped and re-made on the next command once Redis is back."""
    return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
                                retry=Retry(NoBackoff(), 0), health_check_interval=0)


# redis-py wraps socket errors in its own ConnectionError/TimeoutError; OSError is a belt-and-braces catch.
REDIS_ERRORS = (redis.RedisError, OSError)


OWNER_DOMAIN = b"pdserve-prefix-owner"
MAX_WORKER_ID_CHARS = 256
SIGNATURE_CHARS = 64  # an HMAC-SHA256 in hex
# Verdicts kept on owner entries before they are all forgotten (each is a block and one worker's claim on it).
MAX_OWNER_VERDICTS = 1 << 16


@OWNERSHIP_STORES.register("redis")
class RedisOwnership(OwnershipStore):
    """Ownership in Redis, shared by every router and prefill worker pointing at the same server and prefix.

    Keys (hex = the block hash in lowercase hex):
      {prefix}:blk:{hex}       SET of the owners of that block: worker ids, or with a secret "{worker id}|{mac}"
      {prefix}:wblk:{worker}   SET of hex hashes the worker holds (so drop_worker finds them)
    Both expire `ttl_s` after the last record() touching them: the backstop for a worker that died unannounced.

    With `secret` (the internal token) every owner is written signed: mac = HMAC-SHA256 of the block and the worker
    id, so a claim copied to another block, or naming another worker, does not verify; match() uses only owners that
    verify and passes each other one to on_rejected(reason, key) (reason: "malformed", "unsigned", "signature").
    NOTE: a claim carries no time, unlike a registration: a set member must be the same bytes to be removed, and a
    replayed claim only repeats what that worker once held (ownership is advisory: one prefix miss at worst).
    """

    def __init__(self, url: str, key_prefix: str = "pdserve", socket_timeout: float = 0.5, ttl_s: int = 3600,
                 secret: Optional[str] = None, on_rejected: Optional[Callable[[str, str], None]] = None):
        self.key_prefix, self.ttl_s, self._secret, self._on_rejected = key_prefix, int(ttl_s), secret, on_rejected
        self._redis = redis_client(url, socket_timeout)
        self._verdicts: Verdicts[tuple[Optional[str], Optional[str]]] = Verdicts()

    def _blk(self, hex_hash: str) -> str:
        return f"{self.key_prefix}:blk:{hex_hash}"

    def _wblk(self, worker_id: str) -> str:
        return f"{self.key_prefix}:wblk:{worker_id}"

    def _owner(self, hex_hash: str, worker_id: str) -> str:
        """The set member naming worker_id as an owner of block hex_hash: signed when there is a secret."""
        if not self._secret:
            return worker_id
        return f"{worker_id}|{mac(self._secret, OWNER_DOMAIN, _owner_payload(hex_hash, worker_id))}"

    def _run(self, fill, transaction: bool = False) -> list:
        """Queue commands with `fill(pipe)` and send them in one round trip; any Redis failure -> OwnershipUnavailable.

        NOTE: a fresh pipeline per call, reset on exit even after an error, so a failed call leaves no half-filled
        command buffer or broken connection behind; the pool reconnects on the next call."""
        try:
            with self._redis.pipeline(transaction=transaction) as pipe:
                fill(pipe)
                return pipe.execute()
        except REDIS_ERRORS as e:
            raise OwnershipUnavailable(f"redis ownership store: {type(e).__name__}: {e}") from e

    def record(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        hexes = [bytes(h).hex() for h in hashes]

        def fill(pipe) -> None:
            for hx in hexes:
                pipe.sadd(self._blk(hx), self._owner(hx, worker_id))
                pipe.expire(self._blk(hx), self.ttl_s)
            pipe.sadd(self._wblk(worker_id), *hexes)
            pipe.expire(self._wblk(worker_id), self.ttl_s)
        self._run(fill)

    def remove(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        hexes = [bytes(h).hex() for h in hashes]

        def fill(pipe) -> None:
            for hx in hexes:
                pipe.srem(self._blk(hx), self._owner(hx, worker_id))  # Redis deletes a set once it is empty
            pipe.srem(self._wblk(worker_id), *hexes)
        self._run(fill)

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        if not hashes:
            return {}
        hexes = [bytes(h).hex() for h in hashes]

        def fill(pipe) -> None:
            for hx in hexes:
                pipe.smembers(self._blk(hx))
        owner_sets = self._run(fill)
        self._verdicts.bound(MAX_OWNER_VERDICTS)
        return leading_runs({w for w in (self._verified_owner(hx, m) for m in members) if w is not None}
                            for hx, members in zip(hexes, owner_sets))

    def _verified_owner(self, hex_hash: str, member: bytes) -> Optional[str]:
        """The worker id a block's set member names, or None (reported to on_rejected) for one no worker wrote."""
        if not self._secret:
            return _worker_id(member)
        worker_id, problem = self._verdicts.get((hex_hash, member), lambda: self._check_owner(hex_hash, member))
        if problem is not None and self._on_rejected is not None:
            self._on_rejected(problem, self._blk(hex_hash))
        return worker_id

    def _check_owner(self, hex_hash: str, member: bytes) -> tuple[Optional[str], Optional[str]]:
        """(worker id, None) for a member signed with the secret, else (None, why not)."""
        text = _worker_id(member, MAX_WORKER_ID_CHARS + 1 + SIGNATURE_CHARS)
        if text is None:
            return None, "malformed"
        worker_id, sep, signature = text.rpartition("|")
        if not sep or not worker_id:
            return None, "unsigned"
        if not signature_matches(signature, self._secret, OWNER_DOMAIN, _owner_payload(hex_hash, worker_id)):
            return None, "signature"
        return worker_id, None

    def drop_worker(self, worker_id: str) -> None:
        index = self._wblk(worker_id)

        def take_index(pipe) -> None:
            pipe.smembers(index)
            pipe.delete(index)

        def forget_blocks(pipe) -> None:
            for hx in held:
                if _HEX.fullmatch(hx):  # (Redis data is untrusted: anything else names no block of ours)
                    hx = hx.decode()
                    # Both forms: what this worker wrote before a restart with (or without) the secret goes too.
                    pipe.srem(self._blk(hx), worker_id, self._owner(hx, worker_id))
        # Read and delete the index atomically (MULTI), so blocks recorded meanwhile land in a fresh index.
        held, _ = self._run(take_index, transaction=True)
        if held:
            self._run(forget_blocks)

    def close(self) -> None:
        self._redis.close()


_HEX = re.compile(rb"[0-9a-f]{1,128}")


def _owner_payload(hex_hash: str, worker_id: str) -> bytes:
    return f"{hex_hash}\0{worker_id}".encode()


def _worker_id(member: bytes, max_chars: int = MAX_WORKER_ID_CHARS) -> Optional[str]:
    """A block owner's id as the store holds it, or None for a member no worker wrote (Redis data is untrusted:
    one such entry must not fail the prompts whose block it sits on)."""
    try:
        text = member.decode()
    except UnicodeDecodeError:
        return None
    return text if text and text.isprintable() and len(text) <= max_chars else None
