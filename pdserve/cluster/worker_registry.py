"""Workers announce themselves in Redis so routers find them without a static list of addresses.

Key layout: `{prefix}:worker:{role}:{worker_id}` = JSON of the worker's info (at least worker_id, role, address),
written with a TTL of ttl_s and rewritten every ttl_s / 3 by a heartbeat thread. A worker that dies stops writing
and drops out of discovery within ttl_s; one that shuts down cleanly deletes its key at once. Because every heartbeat
is a full SET, a Redis restart (which loses the data when persistence is off) heals within one heartbeat.

Trust: anyone who can write to Redis can write such a key. With a secret (the `--internal-token`), every heartbeat
signs its entry: `signed_at` (unix seconds) and `signature` = HMAC-SHA256(secret, the entry's other fields as
canonical JSON). A router given the same secret uses only entries whose signature verifies and whose `signed_at` is
within `max_age_s` of its clock, so a forged entry is ignored (the router never dials it, hence never sends it the
token) and a copied one stops working after max_age_s. Without a secret nothing can be verified: whoever writes to
Redis decides where the router sends prompts.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Optional, Union

import redis

from .ownership import REDIS_ERRORS, redis_client
from .signing import Verdicts, mac, signature_matches

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")
SIGNATURE_MAX_AGE_S = 30.0  # a signed entry older (or newer) than this by the reader's clock is refused


class RegistryUnavailable(RuntimeError):
    """Redis cannot be reached; the router should keep the workers it already knows."""


def worker_key(key_prefix: str, role: str, worker_id: str) -> str:
    return f"{key_prefix}:worker:{role}:{worker_id}"


REGISTRATION_DOMAIN = b"pdserve-worker-registration"


def _mac(secret: str, fields: dict) -> str:
    return mac(secret, REGISTRATION_DOMAIN, _canonical(fields))


def _canonical(fields: dict) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_registration(info: dict, secret: str, now: Optional[float] = None) -> dict:
    """info with `signed_at` and `signature` (HMAC-SHA256 keyed by secret over everything else) added."""
    fields = {k: v for k, v in info.items() if k not in ("signed_at", "signature")}
    fields["signed_at"] = time.time() if now is None else now
    return {**fields, "signature": _mac(secret, fields)}


def registration_problem(info: dict, secret: str, now: Optional[float] = None,
                         max_age_s: float = SIGNATURE_MAX_AGE_S) -> Optional[str]:
    """None when info is signed with secret and fresh; else why not: "unsigned", "signature" or "expired"."""
    return _signature_problem(info, secret) or _age_problem(info, now, max_age_s)


def _signature_problem(info: dict, secret: str) -> Optional[str]:
    signature, signed_at = info.get("signature"), info.get("signed_at")
    if not isinstance(signature, str) or not isinstance(signed_at, (int, float)) or isinstance(signed_at, bool):
        return "unsigned"
    fields = {k: v for k, v in info.items() if k != "signature"}
    return None if signature_matches(signature, secret, REGISTRATION_DOMAIN, _canonical(fields)) else "signature"


def _verdict(info: dict, secret: str) -> Optional[str]:
    """_signature_problem, or "malformed" for values no worker writes (the check must never raise: one such entry
    stopped every refresh)."""
    try:
        return _signature_problem(info, secret)
    except (ValueError, TypeError, UnicodeError, RecursionError):
        return "malformed"


def _age_problem(info: dict, now: Optional[float], max_age_s: float) -> Optional[str]:
    now = time.time() if now is None else now
    return "expired" if abs(now - info["signed_at"]) > max_age_s else None


class WorkerRegistration:
    """Keeps one worker registered while it runs: `start(info)` once serving, `stop()` on shutdown.

    Never raises for Redis trouble: registration is retried on every heartbeat, with one warning per outage.
    """

    def __init__(self, redis_url: str, key_prefix: str = "pdserve", ttl_s: float = 5.0, socket_timeout: float = 0.5,
                 secret: Optional[str] = None):
        """secret: the internal token; every heartbeat then signs the entry (see the module docstring)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s={ttl_s} must be positive")
        self.key_prefix, self.ttl_s, self._secret = key_prefix, ttl_s, secret
        self._info: dict = {}
        self.key: Optional[str] = None
        self._redis = redis_client(redis_url, socket_timeout)
        self._payload = ""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._failing = False  # inside an outage: warned once already

    def start(self, info: dict) -> "WorkerRegistration":
        """Register `info` now (if Redis is up) and keep it registered from a daemon thread."""
        missing = [k for k in ("worker_id", "role", "address") if not info.get(k)]
        if missing:
            raise ValueError(f"worker info needs {', '.join(missing)}; got {sorted(info)}")
        if info["role"] not in ROLES:
            raise ValueError(f"worker info role={info['role']!r} must be one of {', '.join(ROLES)}")
        if self._thread is not None:
            raise RuntimeError(f"registration {self.key} was already started")
        self.key = worker_key(self.key_prefix, info["role"], info["worker_id"])
        self._info = dict(info)
        self._beat()  # before returning, so a router discovers the worker as soon as start() is done
        self._thread = threading.Thread(target=self._heartbeat, name=f"registry-heartbeat-{info['worker_id']}",
                                        daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        # Signed afresh on every beat: the router refuses entries signed more than SIGNATURE_MAX_AGE_S ago.
        info = sign_registration(self._info, self._secret) if self._secret else self._info
        try:
            self._redis.set(self.key, json.dumps(info), px=max(1, int(self.ttl_s * 1000)))
        except REDIS_ERRORS as e:
            if not self._failing:
                log.warning("cannot register %s in Redis, retrying every %.1f s: %s", self.key, self.ttl_s / 3, e)
            self._failing = True
            return
        if self._failing:
            log.info("registered %s in Redis again", self.key)
        self._failing = False

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self._beat()

    def stop(self, deregister: bool = True) -> None:
        """Stop the heartbeat and delete the key. deregister=False leaves the key to expire after ttl_s, as when
        the process dies."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # NOTE: joined before the delete, so a last heartbeat cannot re-create the key
        if deregister and self.key is not None:
            try:
                self._redis.delete(self.key)
            except REDIS_ERRORS as e:
                log.warning("cannot deregister %s (it expires within %.1f s): %s", self.key, self.ttl_s, e)
        self._redis.close()


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def discover_workers(redis_or_url: Union[str, redis.Redis], role: str, key_prefix: str = "pdserve",
                     socket_timeout: float = 0.5, secret: Optional[str] = None,
                     on_rejected: Optional[Callable[[str, str, dict], None]] = None,
                     verified: Optional[Verdicts] = None) -> list[dict]:
    """Info dicts of the registered workers of `role`, sorted by worker_id; malformed entries are skipped.

    Every entry is untrusted input: one that does not parse, or holds values no worker writes, is skipped (and,
    with `secret`, passed to on_rejected as "malformed"); it never stops the others from being read. With `secret`,
    only entries signed with it and fresh are returned; each other one is passed to on_rejected(key, reason, info)
    (reason: "malformed", "unsigned", "signature", "expired"). `verified`: Verdicts the caller keeps between polls,
    where each entry's signature verdict is kept by its exact content, so an unchanged entry is not verified again
    (bounded by the number of entries). Pass a client to reuse its connections when polling; a URL opens and closes
    one per call. Uses SCAN (never KEYS, which blocks Redis). Raises RegistryUnavailable when Redis cannot be
    reached."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} must be one of {', '.join(ROLES)}")
    own = isinstance(redis_or_url, str)
    client = redis_client(redis_or_url, socket_timeout) if own else redis_or_url
    try:
        keys = list(dict.fromkeys(client.scan_iter(match=f"{_glob_escape(key_prefix)}:worker:{role}:*", count=500)))
        values = client.mget(keys) if keys else []
    except REDIS_ERRORS as e:
        raise RegistryUnavailable(f"worker registry: {type(e).__name__}: {e}") from e
    finally:
        if own:
            client.close()
    if verified is not None:
        verified.bound(4 * len(values) + 1024)
    workers = []
    for key, raw in zip(keys, values):
        if raw is None:
            continue  # expired between SCAN and MGET
        name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
        try:
            info = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            info = None
        if not (isinstance(info, dict) and isinstance(info.get("address"), str) and info["address"].isprintable()
                and isinstance(info.get("worker_id"), (str, int)) and info["worker_id"] != ""):
            log.debug("skipping malformed worker registration %r", key)
            if secret and on_rejected is not None:
                on_rejected(name, "malformed", info if isinstance(info, dict) else {})
            continue
        problem = None
        if secret:
            check = lambda: _verdict(info, secret)  # noqa: E731
            problem = verified.get(raw, check) if verified is not None else check()
            problem = problem or _age_problem(info, None, SIGNATURE_MAX_AGE_S)
        if problem is not None:
            if on_rejected is not None:
                on_rejected(name, problem, info)
            continue
        workers.append(info)
    return sorted(workers, key=lambda w: str(w["worker_id"]))
